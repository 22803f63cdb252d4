"""Quantized checkpoints: what config.json's `quantization_config` says, and the refusal of
every method this runtime does not implement.

A quantization config that is ignored loads quantized tensors as if they were plain weights and
generates other tokens without a word, so anything not implemented here is a ValueError naming
it, raised by load_config (the parent calls it before any child starts).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# The keys under which checkpoints declare quantization (compressed-tensors used the second).
QUANT_KEYS = ("quantization_config", "compression_config")


def check_quantization(raw: dict[str, Any], path: Path) -> None:
    """Refuses any declared quantization by its method's name."""
    for key in QUANT_KEYS:
        qc = raw.get(key)
        if qc is None:
            continue
        method = qc.get("quant_method", "<no quant_method>") if isinstance(qc, dict) else repr(qc)
        raise ValueError(f"{path}: unsupported {key} quant_method {method!r}; "
                         "only unquantized float32/bfloat16/float16 checkpoints are supported")
