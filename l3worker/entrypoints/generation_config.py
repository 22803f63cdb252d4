"""LLM's sampling defaults, as vLLM's `LLM.get_default_sampling_params()` makes them: the fields the
checkpoint's generation_config.json sets among temperature, top_p, top_k, min_p, repetition_penalty
and max_new_tokens (as max_tokens), over vLLM's SamplingParams() defaults. `generation_config`
chooses the file as vLLM's argument does: "auto" (the checkpoint's), "vllm" (none: plain
SamplingParams()) or a folder holding one; `override_generation_config` overrides its fields."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from l3worker.params import SamplingParams

GENERATION_CONFIG = "generation_config.json"
# generation_config.json's names -> SamplingParams' (transformers' max_new_tokens is vLLM's max_tokens)
_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
           "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def default_sampling_fields(model_dir: str | Path, generation_config: str = "auto",
                            override_generation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams fields that differ from vLLM's defaults (vLLM's get_diff_sampling_param).
    ValueError naming the argument for a file that is missing or unreadable."""
    if not isinstance(generation_config, str):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {type(generation_config).__name__}")
    raw: dict[str, Any] = {}
    if generation_config != "vllm":
        path = Path(model_dir if generation_config == "auto" else generation_config).expanduser()
        if path.is_dir():
            path = path / GENERATION_CONFIG
        if path.is_file():
            raw = _read(path)
        elif generation_config != "auto":  # a checkpoint may have none; a folder named for it must
            raise ValueError(f"generation_config={generation_config!r}: no {GENERATION_CONFIG} there "
                             "(give 'auto', 'vllm' or a folder holding one)")
    if override_generation_config is not None:
        if not isinstance(override_generation_config, dict):
            raise TypeError("override_generation_config must be a dict")
        raw = {**raw, **override_generation_config}
    return {_FIELDS[k]: v for k, v in raw.items() if k in _FIELDS and v is not None}


def default_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams() with `fields` over its defaults; ValueError naming generation_config for a
    value SamplingParams refuses."""
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: {e}") from None


def _read(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    return loaded if isinstance(loaded, dict) else {}
