"""RoPE parameters from config.json and the inverse frequencies they give, as transformers
computes them: default, linear and Llama 3 scaling. Other scalings (yarn, dynamic, longrope)
change more than the frequencies and are refused by name.

Configs put these in three places: a top-level `rope_theta`, `rope_scaling` (transformers 4,
often null) and `rope_parameters` (transformers 5, which also carries rope_theta).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of ROPE_TYPES other than "default"
    factor: float
    # llama3 only: the band between the two wavelengths is interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def parse_rope(raw: dict[str, Any], path: Path, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None) from wherever the config puts them; ValueError naming an
    unsupported rope type or a partial rotary factor."""
    theta = raw.get("rope_theta")
    scaling: RopeScaling | None = None
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{path}: '{key}' must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{path}: unsupported {key} rope type {rope_type!r}; supported: {ROPE_TYPES}")
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{path}: unsupported {key} partial_rotary_factor {params['partial_rotary_factor']}")
        if rope_type != "default":
            if params.get("factor") is None:
                raise ValueError(f"{path}: {key} rope type {rope_type!r} needs a 'factor'")
            extra = {} if rope_type == "linear" else {
                k: type(v)(params[k]) for k, v in vars(RopeScaling("", 0.0)).items()
                if k not in ("rope_type", "factor") and params.get(k) is not None}
            scaling = RopeScaling(rope_type, float(params["factor"]), **extra)
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: unsupported partial_rotary_factor {raw['partial_rotary_factor']}")
    return (float(theta) if theta is not None else default_theta), scaling


def inv_freq(theta: float, head_dim: int, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 [head_dim // 2]: transformers' default inverse frequencies, then its scaling."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freq
    if scaling.rope_type == "linear":
        return freq / scaling.factor
    # llama3: long wavelengths divided by the factor, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / scaling.factor, freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
