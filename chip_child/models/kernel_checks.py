"""Every fused kernel checks itself once, on the device it is about to run on, at the model's
shapes, against the torch reference (TORCH_OPS); one that disagrees is replaced by the reference
and named on stderr. Code that has never run on a device is never trusted silently.

`L3WORKER_REFERENCE_KERNELS` forces the reference path for the kernels it names without a check
(chip_child.kernel_choice). The attention backend checks itself in chip_child.attention.self_check."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch

from chip_child.kernel_choice import forced_reference
from chip_child.models.fp8_linear import Fp8Linear, reference_linear
from chip_child.models.qwen3 import TORCH_OPS, LayerOps, Qwen3Weights

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
CHECK_TOKENS = 7  # an odd count: kernels that tile rows see a partial tile
# Largest error allowed, relative to the reference's largest magnitude, by compute dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class KernelVerdict:
    kernel: str
    error: float | None  # relative error against the reference; None when the reference was forced
    used: bool  # the kernel runs; False: the reference replaces it


def checked_ops(ops: LayerOps, w: Qwen3Weights, rope: torch.Tensor, num_heads: int, num_kv_heads: int,
                device: torch.device, dtype: torch.dtype) -> tuple[LayerOps, list[KernelVerdict]]:
    """`ops` with each kernel that differs from TORCH_OPS checked once; a failing or forced one is
    swapped for the reference. Returns the ops to run and a verdict per kernel checked."""
    forced, verdicts, swaps = forced_reference(), [], {}
    for kernel, check in _checks(ops, w, rope, num_heads, num_kv_heads, device, dtype):
        if kernel in forced:
            verdicts.append(KernelVerdict(kernel, None, False))
        else:
            error = check()
            ok = error <= TOLERANCE.get(dtype, 3e-2)
            verdicts.append(KernelVerdict(kernel, error, ok))
            if not ok:
                print(f"chip-child: the {ops.name} kernel {kernel} failed its self-check on {device} (relative "
                      f"error {error:.3g}): the torch reference runs instead", file=sys.stderr, flush=True)
        if not verdicts[-1].used:
            swaps[kernel] = getattr(TORCH_OPS, kernel)
            if kernel == "qk_norm_rope":  # the two read the rotations in each one's own form
                swaps["rope_rows"] = TORCH_OPS.rope_rows
    return (replace(ops, **swaps) if swaps else ops), verdicts


def check_fp8_gemms(w: Qwen3Weights, device: torch.device) -> list[KernelVerdict]:
    """The W8A8 GEMM each kind of kept-fp8 projection runs (F.scaled_mm, our Triton kernel),
    checked once on the first projection of that kind, at its shape, against the reference math;
    a failing or forced kind falls back to the reference in every layer (weights unchanged)."""
    layers = [(lw, name) for lw in w.layers for name in PROJECTIONS if isinstance(getattr(lw, name), Fp8Linear)]
    forced, verdicts = "fp8_gemm" in forced_reference(), []
    for gemm in sorted({getattr(lw, name).gemm for lw, name in layers} - {"torch"}):
        first = next(getattr(lw, name) for lw, name in layers if getattr(lw, name).gemm == gemm)
        kernel = f"fp8_gemm:{gemm}"
        if forced:
            verdicts.append(KernelVerdict(kernel, None, False))
        else:
            x = torch.randn(CHECK_TOKENS, first.weight.shape[1], generator=torch.Generator().manual_seed(0))
            x = x.to(device=device, dtype=first.out_dtype)
            want = reference_linear(x, first.weight, first.scale_inv, first.block, first.out_dtype)
            error = _error(first(x), want)
            verdicts.append(KernelVerdict(kernel, error, error <= TOLERANCE.get(first.out_dtype, 3e-2)))
            if not verdicts[-1].used:
                print(f"chip-child: the fp8 GEMM {gemm} failed its self-check on {device} (relative error "
                      f"{error:.3g}): the reference math runs instead", file=sys.stderr, flush=True)
        if not verdicts[-1].used:
            for lw, name in layers:
                if getattr(lw, name).gemm == gemm:
                    setattr(lw, name, replace(getattr(lw, name), gemm="torch"))
    return verdicts


def _checks(ops: LayerOps, w: Qwen3Weights, rope: torch.Tensor, num_heads: int, num_kv_heads: int,
            device: torch.device, dtype: torch.dtype) -> list[tuple[str, Callable[[], float]]]:
    lw = w.layers[0]
    hidden = w.norm.shape[0]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    h, delta = rand(CHECK_TOKENS, hidden), rand(CHECK_TOKENS, hidden)
    checks = []
    if ops.add_rms_norm is not TORCH_OPS.add_rms_norm:
        def add_rms_norm() -> float:
            got, want = ops.add_rms_norm(h, delta, lw.input_norm, w), TORCH_OPS.add_rms_norm(h, delta, lw.input_norm, w)
            return max(_error(g, r) for g, r in zip(got, want))
        checks.append(("add_rms_norm", add_rms_norm))
    if ops.qk_norm_rope is not TORCH_OPS.qk_norm_rope:
        def qk_norm_rope() -> float:
            qk = rand(CHECK_TOKENS, num_heads + num_kv_heads, rope.shape[-1])
            positions = torch.arange(CHECK_TOKENS, device=device) * 3 % rope.shape[0]
            got = ops.qk_norm_rope(qk.clone(), lw.qk_norm, ops.rope_rows(rope, positions), w)
            want = TORCH_OPS.qk_norm_rope(qk.clone(), lw.qk_norm, TORCH_OPS.rope_rows(rope, positions), w)
            return _error(got, want)
        checks.append(("qk_norm_rope", qk_norm_rope))
    if ops.silu_mul is not TORCH_OPS.silu_mul:
        inter = next((x.gate_up for x in w.layers if x.gate_up is not None), None)
        width = 2 * 64 if inter is None else _out_features(inter)
        checks.append(("silu_mul", lambda: _error(ops.silu_mul(g := rand(CHECK_TOKENS, width)),
                                                  TORCH_OPS.silu_mul(g))))
    moe = next((x.moe for x in w.layers if x.moe is not None), None)
    if moe is not None and ops.moe is not TORCH_OPS.moe:
        checks.append(("moe", lambda: _error(ops.moe(h, moe), TORCH_OPS.moe(h, moe))))
    return checks


def _out_features(weight) -> int:
    """A projection's output width: [in, out] tensors, prepacked layers, [out, in] fp8 layers."""
    if isinstance(weight, torch.Tensor):
        return weight.shape[1]
    return getattr(weight, "out_features", None) or weight.weight.shape[0]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if got.shape != want.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
