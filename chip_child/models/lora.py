"""LoRA adapters in a chip-child: `max_loras` slots of stacked A and B matrices per layer and fused
projection, allocated once beside the weights, and the step's adapter deltas.

Layout. For a fused projection (qkv, o_proj, gate_up, down) of a layer, with R = max_lora_rank
times its parts (q/k/v: 3, gate/up: 2, o and down: 1): A is [in, slots * R] and B [slots * R, out].
Slot s owns columns s*R .. (s+1)*R of A and the same rows of B; within them part j owns
j*max_lora_rank.. (an adapter of lower rank, or without that part, leaves zeros), and B places
each part's rows under that part's output columns (zeros elsewhere), so one (x @ A) @ B is the
delta of every part at once. B holds the adapter's scaling already.

A step: each token carries its row's slot (-1: the base model). x @ A gives every slot's
shrink; a mask keeps only the token's own slot's columns (zeros for the base); @ B expands. So a
batch mixing adapters is three static-shape ops per projection, with no grouping on the host,
and a decode graph captures it (loading a slot rewrites the same tensors). The cost is the
shrink and expand of all slots for every token: small next to the projection while
slots * R is small next to its width.

Tensor parallel: A and B are sharded like the layer they attach to: the column-parallel parts'
(q, k, v, gate, up) B by output, the row-parallel ones' (o, down) A by input, so the delta of
o_proj and down is a partial sum that the layer's all-reduce completes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from chip_child.models.loader import ModelConfig

FUSED = {"qkv": ("q", "k", "v"), "o_proj": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ROW_PARALLEL = ("o", "down")


def _shard(rank: int, world: int, size: int) -> slice:
    step = size // world
    return slice(rank * step, (rank + 1) * step)


class LoraSlots:
    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 rank: int = 0, world: int = 1):
        """`cfg`: the whole model's config (not a shard's)."""
        self.slots, self.max_rank, self.rank, self.world = slots, max_rank, rank, world
        hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        # each part's (in, out) in the whole model
        self.dims = {"q": (hidden, cfg.num_heads * hd), "k": (hidden, cfg.num_kv_heads * hd),
                     "v": (hidden, cfg.num_kv_heads * hd), "o": (cfg.num_heads * hd, hidden),
                     "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
        sparse = set(cfg.moe.sparse_layers) if cfg.moe is not None else set()
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for layer in range(cfg.num_layers):
            a, b = {}, {}
            for name, parts in FUSED.items():
                if name in ("gate_up", "down") and layer in sparse:
                    continue  # a MoE layer's MLP takes no adapter
                width = slots * max_rank * len(parts)
                a[name] = torch.zeros(self._in(parts[0]), width, dtype=dtype, device=device)
                b[name] = torch.zeros(width, sum(self._out(p) for p in parts), dtype=dtype, device=device)
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
        """The step's masks from each token's slot (int64 [T], -1: none)."""
        onehot = (token_slots[:, None] == torch.arange(self.slots, device=token_slots.device)[None, :])
        dtype = next(iter(self.a[0].values())).dtype if self.a and self.a[0] else torch.float32
        onehot = onehot.to(dtype)
        masks = {k: onehot.repeat_interleave(self.max_rank * k, 1) for k in {len(p) for p in FUSED.values()}}
        return LoraStep(self, masks)

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
                    a = a[:, _shard(self.rank, self.world, a.shape[1])]
                else:
                    b = b[_shard(self.rank, self.world, b.shape[0])]
                rank = a.shape[0]
                cols = slice(slot * r * len(parts) + j * r, slot * r * len(parts) + j * r + rank)
                first = sum(self._out(p) for p in parts[:j])
                self.a[layer][name][:, cols].copy_(a.t())
                self.b[layer][name][cols, first:first + b.shape[0]].copy_(b.t())

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for a_layer, b_layer in zip(self.a, self.b):
            for name, a in a_layer.items():
                width = self.max_rank * len(FUSED[name])
                a[:, slot * width:(slot + 1) * width].zero_()
                b_layer[name][slot * width:(slot + 1) * width].zero_()


@dataclass
class LoraStep:
    slots: LoraSlots
    masks: dict[int, torch.Tensor]  # parts per projection -> [T, slots * max_rank * parts]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """y (the projection of x) plus each token's adapter delta, in place."""
        a = self.slots.a[layer].get(name)
        if a is None:
            return y
        shrink = torch.mm(x, a).mul_(self.masks[len(FUSED[name])])
        return y.addmm_(shrink, self.slots.b[layer][name])
