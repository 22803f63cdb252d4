"""Triton kernels of the fused layer stages (chip_child.models.fused). Imported only when those are used,
so the rest of the package never needs triton (set TRITON_INTERPRET=1 before the first import to
run them on cpu tensors).

Each kernel does in one pass what the torch reference does in several ops, rounding to the model
dtype where the reference does (after an add, a norm's cast back, a product), so bfloat16 results
differ from the reference only through the order of the fp32 sums.

- `add_rms_norm_kernel`: one program per token: h + delta (stored as the new residual), then
  Qwen3's RMSNorm of it.
- `qk_norm_rope_kernel`: one program per (token, BLOCK_H heads) of the fused q|k projection, in
  place: per-head RMSNorm (unless HAS_NORM is false), then rotate-half RoPE read from the rope
  table by position.
- `silu_mul_kernel`: silu(gate) * up over [tokens, 2 * inter] -> [tokens, inter].
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(h_ptr, delta_ptr, h_out_ptr, x_out_ptr, w_ptr, n_cols, stride_h, stride_d, stride_ho,
                        stride_xo, eps, inv_n, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * stride_ho + cols, h, mask=mask)
    x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) * inv_n + eps)
    y = (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * stride_xo + cols, (w * y).to(x_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_rope_kernel(qk_ptr, w_ptr, rope_ptr, pos_ptr, n_heads, stride_t, stride_h, stride_rope, eps, inv_d,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate-half's source of each element
    mask = (heads < n_heads)[:, None] & (d < HEAD_DIM)[None, :]
    row = qk_ptr + t * stride_t + heads[:, None] * stride_h
    dt = qk_ptr.dtype.element_ty
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) * inv_d + eps)[:, None]
        w = tl.load(w_ptr + heads[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + heads[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        n = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        nr = (wr * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        n = x
        nr = xr
    # The table's row: cos, then sin with rotate-half's sign folded into its first half.
    table = rope_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_rope
    cos = tl.load(table + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table + HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    out = (n * cos).to(dt).to(tl.float32) + (nr * sin).to(dt).to(tl.float32)
    tl.store(row + d[None, :], out.to(dt), mask=mask)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)
