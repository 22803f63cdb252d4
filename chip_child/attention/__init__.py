"""Attention backends: one interface (chip_child.attention.base), three implementations.

| name     | devices                                   | cache layout                                   |
| -------- | ----------------------------------------- | ---------------------------------------------- |
| `torch`  | cpu, cuda, npu (the reference)            | [layers, 2, kv_heads, pages, page_size, head_dim] |
| `cpu`    | cpu (torch, decode on a kernel of our own) | [layers, 2, kv_heads, pages, page_size, head_dim] |
| `triton` | cuda (cpu under TRITON_INTERPRET=1)       | [layers, 2, pages, page_size, kv_heads, head_dim] |
| `npu`    | npu (torch_npu)                           | [layers, 2, pages, page_size, kv_heads, head_dim] |

`get_backend(device_type, name=None)` picks the class: the default is `cpu` on cpu, `triton`
on cuda (where triton imports; else `torch`) and `npu` on npu; `name` overrides it.
"""
from __future__ import annotations

import importlib.util
import os

from chip_child.attention.base import (AttentionBackend, AttentionMetadata, AttentionSpec, StepPlan,
                                       WorkspaceShapes, cache_dtype_of)

BACKEND_NAMES = ("torch", "cpu", "triton", "npu")
DEVICE_TYPES = ("cpu", "cuda", "npu")

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "StepPlan", "WorkspaceShapes", "BACKEND_NAMES",
           "cache_dtype_of",
           "get_backend", "backend_choices", "default_backend_name", "triton_importable", "triton_interpreted"]


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_choices(device_type: str) -> tuple[str, ...]:
    """The backends that can run on `device_type` here."""
    choices = ["torch", "cpu"] if device_type == "cpu" else ["torch"]
    if triton_importable() and (device_type == "cuda" or (device_type == "cpu" and triton_interpreted())):
        choices.append("triton")
    if device_type == "npu":
        choices.append("npu")
    return tuple(choices)


def default_backend_name(device_type: str) -> str:
    if device_type == "npu":
        return "npu"
    if device_type == "cuda" and triton_importable():
        return "triton"
    return "cpu" if device_type == "cpu" else "torch"


def get_backend(device_type: str, name: str | None = None) -> type[AttentionBackend]:
    """The backend class for `device_type` ("cpu", "cuda", "npu"): `name` when given, else the
    device's default. ValueError (naming attention_backend and the choices) for an unknown name
    or one that cannot run on that device."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"attention_backend: unknown device type {device_type!r}, expected one of {DEVICE_TYPES}")
    if name is None:
        name = default_backend_name(device_type)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    choices = backend_choices(device_type)
    if name not in choices:
        why = ""
        if name == "triton" and not triton_importable():
            why = " (the triton package is not installed)"
        elif name == "triton" and device_type == "cpu":
            why = " (only under TRITON_INTERPRET=1)"
        raise ValueError(f"attention_backend={name!r} cannot run on {device_type}{why}; "
                         f"choices for {device_type}: {choices}")
    if name == "torch":
        from chip_child.attention.torch_backend import TorchAttention

        return TorchAttention
    if name == "cpu":
        from chip_child.attention.cpu_backend import CpuAttention

        return CpuAttention
    if name == "triton":
        from chip_child.attention.triton_backend import TritonAttention

        return TritonAttention
    from chip_child.attention.npu_backend import NpuAttention

    return NpuAttention
