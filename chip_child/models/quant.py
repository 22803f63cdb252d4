"""Quantized checkpoints: what config.json's `quantization_config` says, and the refusal of
every method this runtime does not implement.

A quantization config that is ignored loads quantized tensors as if they were plain weights and
generates other tokens without a word, so anything not implemented here is a ValueError naming
it, raised by load_config (the parent calls it before any child starts). Implemented: block FP8
as the Qwen3-*-FP8 releases store it (chip_child.models.fp8), and the same format made at load from a
plain checkpoint when `quantization="fp8"` asks for it (vLLM's name for the argument).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The keys under which checkpoints declare quantization (compressed-tensors used the second).
QUANT_KEYS = ("quantization_config", "compression_config")
SUPPORTED = "fp8 with weight_block_size and activation_scheme 'dynamic'"
METHODS = ("fp8",)  # what quantization= may name
AT_LOAD_BLOCK = (128, 128)  # the block of the Qwen3-*-FP8 releases


@dataclass(frozen=True)
class BlockFp8:
    """float8_e4m3fn weights, each (rows x cols) block scaled by one float32 in the tensor's
    `weight_scale_inv` companion: weight = fp8 * scale_inv, per block."""

    block: tuple[int, int]  # weight_block_size: [rows of the output dim, columns of the input dim]
    quant_method: str = "fp8"
    at_load: bool = False  # the checkpoint is plain: the loader quantizes its projections (quantization="fp8")


def requested_quantization(method: str | None, declared: BlockFp8 | None, path: Path) -> BlockFp8 | None:
    """What `quantization=method` makes of a checkpoint that declares `declared`: None keeps the
    declaration; "fp8" keeps a stored FP8 checkpoint as it is and quantizes a plain one at load
    in the releases' format. Any other name, or one that contradicts the checkpoint, is a ValueError."""
    if method is None:
        return declared
    if not isinstance(method, str):
        raise TypeError(f"quantization must be a method name such as 'fp8' or None, got {method!r}")
    if declared is not None and method != declared.quant_method:
        raise ValueError(f"quantization={method!r} contradicts {path}: its quantization_config quant_method is "
                         f"{declared.quant_method!r}")
    if method not in METHODS:
        raise ValueError(f"unsupported quantization {method!r}; supported: {', '.join(METHODS)}")
    return declared or BlockFp8(block=AT_LOAD_BLOCK, at_load=True)


def parse_quantization(raw: dict[str, Any], path: Path) -> BlockFp8 | None:
    """The declared quantization, or None; ValueError naming any method or variant not implemented."""
    found: BlockFp8 | None = None
    for key in QUANT_KEYS:
        qc = raw.get(key)
        if qc is None:
            continue
        if not isinstance(qc, dict):
            raise ValueError(f"{path}: {key} must be an object, got {qc!r}")
        method = qc.get("quant_method", "<no quant_method>")
        if method != "fp8" or key != "quantization_config":
            raise ValueError(f"{path}: unsupported {key} quant_method {method!r}; supported: {SUPPORTED}")
        found = _block_fp8(qc, path)
    return found


def _block_fp8(qc: dict[str, Any], path: Path) -> BlockFp8:
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"{path}: unsupported quantization_config fp8 without weight_block_size (per-tensor "
                         f"scales); supported: {SUPPORTED}")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{path}: quantization_config weight_block_size must be two positive ints, got {block!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{path}: unsupported quantization_config fp8 activation_scheme {scheme!r}; "
                         f"supported: {SUPPORTED}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{path}: unsupported quantization_config fp8 fmt {fmt!r}; supported: e4m3")
    return BlockFp8(block=(block[0], block[1]))
