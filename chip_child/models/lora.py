"""LoRA adapters in a chip-child: `max_loras` slots of stacked A and B matrices per layer and fused
projection, allocated once beside the weights, and the step's adapter deltas.

Layout. For a fused projection (qkv, o_proj, gate_up, down) of a layer, with R = max_lora_rank
times its parts (q/k/v: 3, gate/up: 2, o and down: 1): A is [slots, in, R] and B [slots, R, out].
Within a slot's R, part j owns j*max_lora_rank.. (an adapter of lower rank, or without that part,
leaves zeros), and B places each part's rows under that part's output columns (zeros elsewhere),
so one (x @ A[s]) @ B[s] is the delta of every part at once. B holds the adapter's scaling.

A step: each token carries its row's slot (-1: the base model), and the delta is computed one of
two ways.

- Grouped (`grouped_step`, eager steps, where the host knows each token's slot): the tokens with
  an adapter are gathered into one [groups, G, in] batch, a group per slot in use (G its largest,
  shorter ones padded with a zero row), and two batched matmuls through those slots' A and B give
  the deltas, added back at their rows (punica's SGMV in four ops). Base rows cost nothing, and a
  step with no adapter skips LoRA entirely.
- Masked (`step`, for a captured decode graph, which cannot follow the host): every token goes
  through every slot's A, a mask keeps each token's own slot (zeros for the base), through B and
  summed over the slots: static shapes, reading the slots from the device (loading a slot
  rewrites the tensors the graph reads), at every slot's work for every token.

Tensor parallel: A and B are sharded like the layer they attach to: the column-parallel parts'
(q, k, v, gate, up) B by output, the row-parallel ones' (o, down) A by input, so the delta of
o_proj and down is a partial sum that the layer's all-reduce completes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from chip_child.models.loader import ModelConfig, projection_dims, shard_slice

FUSED = {"qkv": ("q", "k", "v"), "o_proj": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ROW_PARALLEL = ("o", "down")


class LoraSlots:
    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 rank: int = 0, world: int = 1):
        """`cfg`: the whole model's config (not a shard's)."""
        self.slots, self.max_rank, self.rank, self.world = slots, max_rank, rank, world
        self.device = device
        self.dims = projection_dims(cfg)  # each part's (in, out) in the whole model
        sparse = set(cfg.moe.sparse_layers) if cfg.moe is not None else set()
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for layer in range(cfg.num_layers):
            a, b = {}, {}
            for name, parts in FUSED.items():
                if name in ("gate_up", "down") and layer in sparse:
                    continue  # a MoE layer's MLP takes no adapter
                width = max_rank * len(parts)
                a[name] = torch.zeros(slots, self._in(parts[0]), width, dtype=dtype, device=device)
                b[name] = torch.zeros(slots, width, sum(self._out(p) for p in parts), dtype=dtype, device=device)
            self.a.append(a)
            self.b.append(b)

    def _in(self, part: str) -> int:
        full = self.dims[part][0]
        return full // self.world if part in ROW_PARALLEL else full

    def _out(self, part: str) -> int:
        full = self.dims[part][1]
        return full if part in ROW_PARALLEL else full // self.world

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for side in (self.a, self.b) for layer in side for t in layer.values())

    def step(self, token_slots: torch.Tensor) -> "LoraStep":
        """The masked step from each token's slot on the device (int64 [T], -1: none)."""
        onehot = token_slots[None, :] == torch.arange(self.slots, device=token_slots.device)[:, None]
        dtype = next(iter(self.a[0].values())).dtype
        return LoraStep(self, onehot.to(dtype)[:, :, None])

    def grouped_step(self, token_slots: np.ndarray, device: torch.device) -> "GroupedLoraStep | None":
        """The grouped step from each token's slot on the host (-1: none); None when no token has one."""
        used = np.flatnonzero(token_slots >= 0)
        if not used.size:
            return None
        order = used[np.argsort(token_slots[used], kind="stable")]
        slots, first = np.unique(token_slots[order], return_index=True)
        sizes = np.diff(np.r_[first, len(order)])
        group = int(sizes.max())
        pad = len(token_slots)  # the zero row appended to x
        gather = np.full((len(slots), group), pad, np.int64)
        scatter = np.zeros((len(slots), group), np.int64)  # a pad adds its zero delta to row 0
        for g, (a, n) in enumerate(zip(first, sizes)):
            gather[g, :n] = scatter[g, :n] = order[a:a + n]
        padded = bool((sizes < group).any())
        which = slice(0, len(slots)) if (slots == np.arange(len(slots))).all() else \
            torch.from_numpy(slots.astype(np.int64)).to(device)
        return GroupedLoraStep(self, torch.from_numpy(gather.ravel()).to(device),
                               torch.from_numpy(scatter.ravel()).to(device), which, len(slots), group, padded)

    @torch.inference_mode()
    def load(self, slot: int, path: str) -> None:
        """Slot `slot` takes the adapter in `path` (l3worker.lora.peft_adapter's layout): one
        copy per part into the pooled tensors, this rank's shard of it."""
        self.clear(slot)
        r = self.max_rank
        with safe_open(path, "pt") as f:
            for key in f.keys():
                _, layer, part, side = key.split(".")
                if side != "A":
                    continue
                layer = int(layer)
                name = next(n for n, parts in FUSED.items() if part in parts)
                parts = FUSED[name]
                j = parts.index(part)
                a, b = f.get_tensor(key), f.get_tensor(key[:-1] + "B")  # [rank, in], [out, rank]
                if part in ROW_PARALLEL:
                    a = a[:, shard_slice(self.rank, self.world, a.shape[1])]
                else:
                    b = b[shard_slice(self.rank, self.world, b.shape[0])]
                cols = slice(j * r, j * r + a.shape[0])
                first = sum(self._out(p) for p in parts[:j])
                self.a[layer][name][slot, :, cols].copy_(a.t())
                self.b[layer][name][slot, cols, first:first + b.shape[0]].copy_(b.t())

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for a_layer, b_layer in zip(self.a, self.b):
            for name, a in a_layer.items():
                a[slot].zero_()
                b_layer[name][slot].zero_()


@dataclass
class LoraStep:
    slots: LoraSlots
    weights: torch.Tensor  # [slots, T, 1]: 1 where the token is on that slot

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """y (the projection of x) plus each token's adapter delta, in place."""
        a = self.slots.a[layer].get(name)
        if a is None:
            return y
        shrink = torch.matmul(x, a).mul_(self.weights)  # [slots, T, R]
        return y.add_(torch.bmm(shrink, self.slots.b[layer][name]).sum(0))


@dataclass
class GroupedLoraStep:
    slots: LoraSlots
    gather: torch.Tensor  # [groups * G] the token of each padded position (T: the zero row)
    scatter: torch.Tensor  # [groups * G] the row each delta is added to (0 for a pad: its delta is zero)
    which: slice | torch.Tensor  # the groups' slots
    groups: int
    group: int  # G
    padded: bool

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        a = self.slots.a[layer].get(name)
        if a is None:
            return y
        b = self.slots.b[layer][name]
        source = torch.cat([x, x.new_zeros(1, x.shape[1])]) if self.padded else x
        xs = source.index_select(0, self.gather).view(self.groups, self.group, -1)
        delta = torch.bmm(torch.bmm(xs, a[self.which]), b[self.which])
        return y.index_add_(0, self.scatter, delta.view(-1, delta.shape[-1]))
