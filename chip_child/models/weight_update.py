"""New weights while the child lives: copied into the tensors the model (and any captured decode
graph) already reads, one layer at a time, so memory never holds two models.

A layer is rebuilt from its HF tensors with the load path's own code (fusing, this rank's shard,
fp8), then copied leaf by leaf into the live layer. A prepacked (oneDNN) matrix is opaque to
copies: it is packed again into a new buffer, the old one freed first (the cpu has no graphs).
A layer whose tensors arrive over several updates waits, in host memory, until the last one
comes (RL trainers send their weights in buckets of a few hundred MB, cutting layers anywhere).
"""
from __future__ import annotations

from pathlib import Path

import torch

from chip_child.models.loader import ModelConfig, expected_tensor_shapes, load_weights, unit_of
from chip_child.models.prepack import PackedLinear
from chip_child.models.qwen3 import Qwen3Weights, layer_from_hf, layer_to

def units(cfg: ModelConfig) -> dict[str, set[str]]:
    """Every unit of the model and the HF tensor names it needs, complete."""
    out: dict[str, set[str]] = {}
    for name in expected_tensor_shapes(cfg):
        out.setdefault(unit_of(name), set()).add(name)
    return out


class WeightUpdater:
    """Applies updates to one runtime's weights. `pending` holds the tensors of units that are
    not complete yet (a bucketed update), on the host."""

    def __init__(self, weights: Qwen3Weights, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 rank: int, world: int, expert_parallel: bool, prepack: bool, keep_fp8: bool):
        self.weights, self.cfg, self.dtype, self.device = weights, cfg, dtype, device
        self.rank, self.world, self.expert_parallel = rank, world, expert_parallel
        self.prepack, self.keep_fp8 = prepack, keep_fp8
        self.units = units(cfg)
        self.pending: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def update_from(self, model_dir: str | Path, names: list[str] | None = None) -> dict:
        """Loads `names` (all the model's tensors when None) from the safetensors under `model_dir`
        and applies every unit they complete. The parent checked names and shapes already."""
        wanted = set(names) if names is not None else set(expected_tensor_shapes(self.cfg))
        applied: list[str] = []
        for unit, needed in self.units.items():
            have = wanted & needed
            if not have:
                continue
            state = load_weights(model_dir, self.cfg, self.dtype, "cpu", keep_fp8=self.keep_fp8, only=have)
            if have | {n for n in self.pending if n in needed} != needed:  # the rest comes later
                self.pending.update((n, t.clone()) for n, t in state.items())  # the file goes away
                continue
            state.update((n, self.pending.pop(n)) for n in needed - have)
            self._apply(unit, state)
            applied.append(unit)
        return {"applied_units": len(applied), "pending_tensors": sorted(self.pending)}

    def drop_pending(self) -> list[str]:
        dropped = sorted(self.pending)
        self.pending.clear()
        return dropped

    def _apply(self, unit: str, state: dict[str, torch.Tensor]) -> None:
        w = self.weights
        if unit.startswith("layer "):
            i = int(unit.split()[1])
            new = layer_to(layer_from_hf(state, self.cfg, i, self.rank, self.world, self.expert_parallel),
                           self.device)
            copy_into(w.layers[i], new, unit)  # a prepacked matrix is packed again there
        elif unit == "model.embed_tokens.weight":
            copy_into(w.embed, state[unit].to(self.device), unit)
            if w.tied and isinstance(w.lm_head, PackedLinear):  # its own packed copy of the embedding
                repack(w.lm_head, w.embed.t())
        elif unit == "model.norm.weight":
            copy_into(w.norm, state[unit].to(self.device), unit)
        elif unit == "lm_head.weight":
            copy_into(w.lm_head, state[unit].to(self.device).t(), unit)
        else:
            raise ValueError(f"no tensor of the model is named {unit!r}")


def repack(packed: PackedLinear, weight_t: torch.Tensor) -> None:
    """Packs new [in, out] values into a prepacked matrix, the old buffer released first: a
    packed buffer cannot be written in place, and holding both would grow the heap by the model."""
    packed.weight = None
    packed.weight = PackedLinear(weight_t).weight


def copy_into(old: object, new: object, what: str) -> None:
    """Copies `new`'s tensors into `old`'s, leaf by leaf, keeping old's tensor objects (and so
    their device addresses)."""
    if old is None or new is None:
        if (old is None) != (new is None):
            raise ValueError(f"{what}: the update has a tensor the model lacks, or the reverse")
        return
    if isinstance(old, torch.Tensor):
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"{what}: {tuple(new.shape)} {new.dtype} where the model holds "
                             f"{tuple(old.shape)} {old.dtype}")
        old.copy_(new)
        return
    if isinstance(old, PackedLinear):
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != (old.in_features, old.out_features):
            raise ValueError(f"{what}: {tuple(getattr(new, 'shape', ()))} where the model holds a packed "
                             f"{(old.in_features, old.out_features)}")
        repack(old, new)
        return
    fields = vars(old) if hasattr(old, "__dict__") else {k: getattr(old, k) for k in old.__slots__}
    for key, value in fields.items():
        if isinstance(value, (torch.Tensor, PackedLinear)) or hasattr(value, "__dict__") and not isinstance(
                value, (type, torch.dtype)):
            copy_into(value, getattr(new, key), f"{what}.{key}")

