"""A PEFT LoRA checkpoint read and checked against the base model, and written in the layout the
chip-children copy into their adapter slots.

Taken: LoRA (`peft_type` "LORA") on the projections q/k/v/o of the attention and gate/up/down of
a dense MLP, any rank up to `max_lora_rank`, `lora_alpha` scaling (alpha / r, or alpha / sqrt(r)
with `use_rslora`). Refused by name: DoRA, `modules_to_save`, embedding or lm_head adapters,
per-module rank or alpha patterns, LoRA biases, experts of a MoE layer, any other target.

The written file (safetensors, fp32) holds per layer and target `layers.{i}.{target}.A` [r, in] and
`layers.{i}.{target}.B` [out, r], B already multiplied by the scaling: the delta of a projection is
x @ A^T @ B^T, added to its output.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from chip_child.models.loader import ModelConfig, projection_dims

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.lora_([AB])\.weight$")
_PLACES = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}


@dataclass
class PeftAdapter:
    rank: int
    scaling: float
    tensors: dict[str, torch.Tensor]  # the written layout's names -> fp32 tensors (B scaled)

    @property
    def targets(self) -> set[str]:
        return {name.split(".")[2] for name in self.tensors}


def read_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> PeftAdapter:
    """The adapter at `path`, checked; ValueError naming what is refused (the field and its limit)."""
    folder = Path(path)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"lora_path: {folder} has no adapter_config.json (a PEFT LoRA checkpoint)")
    if not weights.is_file():
        raise ValueError(f"lora_path: {folder} has no adapter_model.safetensors")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    rank, alpha = _check_config(raw, max_lora_rank)
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            m = _MODULE.search(key)
            if m is None:
                raise ValueError(f"lora_path: {key} adapts a module LoRA is not served on here (targets: the "
                                 f"attention's q/k/v/o and a dense MLP's gate/up/down projections)")
            layer, place, target, part = int(m[1]), m[2], m[3], m[4]
            if target not in _PLACES or _PLACES[target] != place:
                raise ValueError(f"lora_path: {key}: unknown target module {target}_proj")
            if layer >= cfg.num_layers:
                raise ValueError(f"lora_path: {key}: layer {layer} beyond the model's {cfg.num_layers}")
            if place == "mlp" and cfg.moe is not None and layer in cfg.moe.sparse_layers:
                raise ValueError(f"lora_path: {key}: LoRA on a MoE layer's experts is not supported")
            found.setdefault((layer, target), {})[part] = f.get_tensor(key).float()
    if not found:
        raise ValueError(f"lora_path: {weights} holds no LoRA weights")
    tensors = {}
    for (layer, target), parts in sorted(found.items()):
        if set(parts) != {"A", "B"}:
            raise ValueError(f"lora_path: layer {layer} {target}_proj has lora_{'AB'.replace(''.join(parts), '')} "
                             "missing")
        a, b = parts["A"], parts["B"]
        want_in, want_out = projection_dims(cfg)[target]
        if a.shape != (rank, want_in) or b.shape != (want_out, rank):
            raise ValueError(f"lora_path: layer {layer} {target}_proj: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)}, expected ({rank}, {want_in}) / ({want_out}, {rank}) for r={rank} "
                             "on this model")
        tensors[f"layers.{layer}.{target}.A"] = a.contiguous()
        tensors[f"layers.{layer}.{target}.B"] = (b * scaling).contiguous()
    return PeftAdapter(rank, scaling, tensors)


def _check_config(raw: dict, max_lora_rank: int) -> tuple[int, float]:
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("use_dora"):
        raise ValueError("lora_path: DoRA adapters (use_dora) are not supported")
    if raw.get("modules_to_save"):
        raise ValueError(f"lora_path: modules_to_save {raw['modules_to_save']!r} is not supported (whole modules "
                         "trained beside the adapter)")
    for name in ("rank_pattern", "alpha_pattern"):
        if raw.get(name):
            raise ValueError(f"lora_path: {name} (per-module ranks or alphas) is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"lora_path: bias={raw['bias']!r} is not supported (LoRA without biases only)")
    if raw.get("fan_in_fan_out"):
        raise ValueError("lora_path: fan_in_fan_out adapters (Conv1D models) are not supported")
    targets = raw.get("target_modules") or []
    for t in [targets] if isinstance(targets, str) else targets:
        if t in ("embed_tokens", "lm_head") or str(t).endswith(("embed_tokens", "lm_head")):
            raise ValueError(f"lora_path: target_modules includes {t}: embedding and lm_head adapters are not "
                             "supported")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path: r must be an int >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"lora_path: the adapter's rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_path: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def write_adapter(adapter: PeftAdapter, file: Path) -> None:
    save_file(adapter.tensors, str(file), metadata={"rank": str(adapter.rank)})
