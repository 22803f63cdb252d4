"""A layer's elementwise stages on the cpu in bf16 (layer_ops.cpp): add_rms_norm, qk_norm_rope
and silu_mul, one pass each instead of torch's several ops, each with its intermediate
roundings where the reference (chip_child.models.qwen3.TORCH_OPS) has them.

`cpu_layer_ops(dtype)` is the LayerOps the runtime uses on the cpu: these for bf16 where KERNEL
(AVX-512) or, on a cpu without AVX-512, AVX2_KERNEL (layer_ops_avx2.cpp) builds and passes its
check, else TORCH_OPS (the reason printed once). A shape the kernels do
not take (a hidden size not a multiple of 16, a head size not a multiple of 32, a float32 norm
weight) runs the reference op. The runtime then checks each op at the model's own shapes
(chip_child.models.kernel_checks), as every fused kernel is."""
from __future__ import annotations

import ctypes
import sys
from dataclasses import replace
from types import SimpleNamespace

import torch

from chip_child.cpu_kernels.build import AVX2_FMA, AVX2_FMA_FLAGS, CheckedKernel, first_usable
from chip_child.models.qwen3 import TORCH_OPS, LayerOps, Qwen3Weights, rope_table_and_positions

BF16 = torch.bfloat16
CHECK_TOLERANCE = 2e-2  # bf16: a rounding or two apart from torch's, relative to the largest value
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.l3_add_rms_norm.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _I64, _PTR, _I64, _I64, _I64]
    lib.l3_qk_norm_rope.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _F32, _PTR, _PTR, _INT, _PTR, _I64, _I64, _I64]
    lib.l3_silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64]
    for f in (lib.l3_add_rms_norm, lib.l3_qk_norm_rope, lib.l3_silu_mul):
        f.restype = None
    return lib


_said: set[str] = set()


def _reference(op: str, shape: tuple) -> None:
    """Says once per op and process that a shape went to the reference op."""
    if op not in _said:
        _said.add(op)
        print(f"chip-child: {op} runs as torch ops for a shape the cpu kernel does not take: {shape}",
              file=sys.stderr, flush=True)


def _rows(x: torch.Tensor) -> bool:
    """A [T, n] bf16 tensor with unit column stride (rows may be strided)."""
    return x.dtype == BF16 and x.dim() == 2 and x.stride(1) == 1


def _head_rows(weight: torch.Tensor, heads: int, hd: int) -> bool:
    """A contiguous bf16 norm weight of one row [hd] for every head, or a row per head [heads, hd]."""
    return weight.dtype == BF16 and weight.is_contiguous() and weight.shape in ((hd,), (heads, hd))


def make_ops(lib: ctypes.CDLL) -> LayerOps:
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, w: Qwen3Weights):
        t, n = h.shape
        if not (_rows(h) and (delta is None or _rows(delta)) and weight.dtype == BF16 and n % 16 == 0
                and n <= 16384 and weight.is_contiguous()):
            _reference("add_rms_norm", (tuple(h.shape), h.dtype, weight.dtype))
            return TORCH_OPS.add_rms_norm(h, delta, weight, w)
        x = torch.empty(t, n, dtype=BF16)
        h_out = h if delta is None else torch.empty(t, n, dtype=BF16)
        if t:
            lib.l3_add_rms_norm(h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
                                0 if delta is None else delta.stride(0), weight.data_ptr(), w.eps_value,
                                h_out.data_ptr(), n, x.data_ptr(), n, t, n)
        return h_out, x

    def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor | None, rows, w: Qwen3Weights) -> torch.Tensor:
        rope, positions = rows
        t, heads, hd = qk.shape
        if not (qk.dtype == BF16 and rope.dtype == BF16 and qk.stride(2) == 1 and hd % 32 == 0 and hd <= 512
                and rope.is_contiguous() and (weight is None or _head_rows(weight, heads, hd))
                and positions.dtype in (torch.int64, torch.int32) and positions.is_contiguous()):
            _reference("qk_norm_rope", (tuple(qk.shape), qk.dtype))
            return TORCH_OPS.qk_norm_rope(qk, weight, TORCH_OPS.rope_rows(rope, positions), w)
        out = torch.empty(t, heads, hd, dtype=BF16)
        if t:
            w_ptr = None if weight is None else weight.data_ptr()
            w_stride = 0 if weight is None or weight.dim() == 1 else hd  # one row for every head, or a row per head
            lib.l3_qk_norm_rope(qk.data_ptr(), qk.stride(0), qk.stride(1), w_ptr, w_stride, w.eps_value,
                                rope.data_ptr(), positions.data_ptr(), int(positions.dtype == torch.int64),
                                out.data_ptr(), t, heads, hd)
        return out

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if not _rows(gate_up):
            _reference("silu_mul", (tuple(gate_up.shape), gate_up.dtype))
            return TORCH_OPS.silu_mul(gate_up)
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(t, n, dtype=BF16)
        if t:
            lib.l3_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, n)
        return out

    return replace(TORCH_OPS, name="cpu", add_rms_norm=add_rms_norm, rope_rows=rope_table_and_positions,
                   qk_norm_rope=qk_norm_rope, silu_mul=silu_mul)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if got.shape != want.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max()).item()


def check_error(lib: ctypes.CDLL) -> float:
    """Largest relative error of the three ops against TORCH_OPS on random bf16 rows: 5 tokens,
    hidden 96, 3 heads of 64, an odd MLP width (a partial vector)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(BF16)

    w = SimpleNamespace(eps=torch.tensor(1e-6), eps_value=1e-6, inv_hidden=torch.tensor(1 / 96),
                        inv_head_dim=torch.tensor(1 / 64))
    ops = make_ops(lib)
    h, delta, weight = rand(5, 96), rand(5, 96), rand(96)
    pairs = zip(ops.add_rms_norm(h, delta, weight, w), TORCH_OPS.add_rms_norm(h, delta, weight, w))
    errors = [_error(a, b) for a, b in pairs]
    freqs = torch.arange(40)[:, None] / 10000 ** (torch.arange(32) / 32)
    emb = torch.cat([freqs, freqs], -1)
    rope = torch.stack([emb.cos(), emb.sin() * torch.cat([-torch.ones(32), torch.ones(32)])], 1).to(BF16)
    # A row per head (a model's q_norm rows, then its k_norm's), one row for all, none.
    qk, positions, head_weights = rand(5, 4, 64)[:, :3], torch.tensor([0, 3, 7, 11, 39]), rand(3, 64)
    for norm in (head_weights, head_weights[0].contiguous(), None):
        errors.append(_error(ops.qk_norm_rope(qk, norm, ops.rope_rows(rope, positions), w),
                             TORCH_OPS.qk_norm_rope(qk, norm, TORCH_OPS.rope_rows(rope, positions), w)))
    gate_up = rand(5, 2 * 101, scale=3.0)
    errors.append(_error(ops.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up)))
    return max(errors)


KERNEL = CheckedKernel("cpu_layer_ops", "layer_ops.cpp",
                       "the layer's elementwise ops run on the next that can (the AVX2 kernels, torch ops)", _bind,
                       check_error, CHECK_TOLERANCE)
# The same functions on AVX2 + FMA (layer_ops_avx2.cpp), used only where KERNEL cannot run.
AVX2_KERNEL = CheckedKernel("cpu_layer_ops_avx2", "layer_ops_avx2.cpp", "the layer's elementwise ops run as torch ops",
                            _bind, check_error, CHECK_TOLERANCE, cpu_flags=AVX2_FMA, compile_flags=AVX2_FMA_FLAGS)


def library() -> ctypes.CDLL | None:
    """The first of KERNEL and AVX2_KERNEL that runs here, or None. `L3WORKER_REFERENCE_KERNELS=
    cpu_layer_ops` turns both off, `cpu_layer_ops_avx2` the second."""
    kernel = first_usable(KERNEL, AVX2_KERNEL)
    return None if kernel is None else kernel.library()


def cpu_layer_ops(dtype: torch.dtype) -> LayerOps:
    """The cpu's LayerOps for `dtype`: these kernels in bf16 where they run, else TORCH_OPS."""
    lib = library() if dtype == BF16 else None
    return TORCH_OPS if lib is None else make_ops(lib)
