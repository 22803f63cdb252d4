"""Fused layer stages for cuda: each of a layer's elementwise chains as one Triton kernel.

On a GPU a decode step is a few hundred small kernels, and each costs a few microseconds even
replayed from a graph: the torch reference (model.TORCH_OPS) spends about 39 kernels a layer,
24 of them in its three RMSNorms. These ops bring a layer to about 10 (residual add + norm, the
projections, q/k norm + RoPE, K/V write, attention, silu * up). A MoE layer's experts run as our
fused MoE (chip_child.models.moe_triton).

`fused_kernels=None` in RuntimeConfig turns them on for cuda where triton imports; True also runs
them on the cpu under TRITON_INTERPRET=1 (the tests), nowhere else.
"""
from __future__ import annotations

import torch

from chip_child.attention import triton_importable, triton_interpreted
from chip_child.device import check_optional_bool
from chip_child.models.qwen3 import LayerOps, Qwen3Weights, rope_table_and_positions

DEVICES = ("cuda",)


def resolve_fused_kernels(setting: bool | None, device_type: str) -> bool:
    """Whether the fused ops are used; ValueError naming `fused_kernels` where they cannot run."""
    check_optional_bool("fused_kernels", setting)
    runnable = triton_importable() and (device_type in DEVICES or (device_type == "cpu" and triton_interpreted()))
    if setting is None:
        return device_type in DEVICES and runnable
    if setting and not runnable:
        why = "the triton package is not installed" if not triton_importable() else \
            "they run on cuda (or on the cpu under TRITON_INTERPRET=1)"
        raise ValueError(f"fused_kernels=True cannot run on {device_type}: {why}")
    return setting


def triton_layer_ops() -> LayerOps:
    from triton import next_power_of_2

    from chip_child.models import fused_kernels as k

    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, w: Qwen3Weights):
        t, n = h.shape
        x = torch.empty_like(h)
        if t == 0:
            return (h if delta is None else h + delta), x
        h_out = h if delta is None else torch.empty_like(h)
        d = h if delta is None else delta
        block = next_power_of_2(n)
        k.add_rms_norm_kernel[(t,)](h, d, h_out, x, weight, n, h.stride(0), d.stride(0), h_out.stride(0), x.stride(0),
                                    w.eps_value, 1.0 / n, HAS_DELTA=delta is not None, BLOCK=block,
                                    num_warps=warps_for(block))
        return h_out, x

    def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor | None, rows, w: Qwen3Weights) -> torch.Tensor:
        rope, positions = rows
        t, heads, hd = qk.shape
        if t == 0:
            return qk
        block_h = min(8, next_power_of_2(heads))
        k.qk_norm_rope_kernel[(t, -(-heads // block_h))](
            qk, qk if weight is None else weight, rope, positions, heads, qk.stride(0), qk.stride(1), rope.stride(0),
            w.eps_value, 1.0 / hd, HEAD_DIM=hd, BLOCK_D=next_power_of_2(hd), BLOCK_H=block_h,
            HAS_NORM=weight is not None, num_warps=4)
        return qk  # written in place: the projection's output is a temporary

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        t, two_inter = gate_up.shape
        inter = two_inter // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
        if t:
            block = min(1024, next_power_of_2(inter))
            k.silu_mul_kernel[(t, -(-inter // block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                       BLOCK=block, num_warps=4)
        return out

    from chip_child.models.moe_triton import triton_moe

    return LayerOps("triton", add_rms_norm, rope_table_and_positions, qk_norm_rope, silu_mul, moe=triton_moe)


def warps_for(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16
