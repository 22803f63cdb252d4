"""Triton kernels of the W8A8 block-FP8 linear layer (chip_child.models.fp8_linear). Imported only when
used (set TRITON_INTERPRET=1 before the first triton import to run them on cpu tensors).

- `group_quant_kernel`: per (row, group of GROUP columns): scale = max(amax, EPS) / 448 and
  q = clamp(x / scale) rounded to float8_e4m3fn, the scale stored at the given strides (row-major for
  our GEMM, column-major for cuBLAS's 1x128 recipe). Divisions are div_rn (IEEE round to
  nearest) so the result equals torch's bit for bit: Triton's `/` is an approximate divide on cuda.
- `block_fp8_gemm_kernel`: C[M, N] = sum over K blocks of (A_q @ B_q^T) * a_scale[m, kb] *
  b_scale[n // GROUP_N, kb], accumulated in fp32; BLOCK_K is the weight block's column count,
  so each K step has one activation scale per row and one weight scale per column
  (the w8a8_block_fp8_matmul semantics of DeepSeek-V3's and vLLM's kernels).
"""
from __future__ import annotations

import triton
import triton.language as tl

# constexpr: a compiled kernel may read only constexpr globals (the interpreter reads any).
FP8_MAX = tl.constexpr(448.0)
EPS = tl.constexpr(1e-10)  # an all-zero group gets a tiny scale, not a division by zero


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to nearest even on the e4m3 grid, in fp32 arithmetic: the cast that
    follows is then exact. Triton's interpreter rounds some values just below a power of two
    down by a whole binade when it casts to fp8 itself (124.3 -> 64), so the kernel never asks it
    to round. The grid step is 2^(e - 3) for exponent e, floored at e = -6 (subnormals); adding
    and subtracting 2^23 steps rounds to a multiple of the step as the fp32 add rounds."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    big = step * 8388608.0
    r = (tl.abs(v) + big) - big
    return tl.where(v < 0, -r, r)


@triton.jit
def group_quant_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_sm, stride_sg, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)
    ok = ks < cols
    x = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), EPS), FP8_MAX)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale)


@triton.jit
def block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_asg,
                          stride_bn, stride_bsn, stride_bsk, stride_cm,
                          GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    b_scale_rows = (rn // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rm64[:, None] * stride_am + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn64[None, :] * stride_bn + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rm64 * stride_asm + kb * stride_asg, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + b_scale_rows + kb * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + rm64[:, None] * stride_cm + rn64[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
