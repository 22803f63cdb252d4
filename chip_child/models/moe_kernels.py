"""Triton kernels of the fused MoE (chip_child.models.moe_triton). Imported only when used (set
TRITON_INTERPRET=1 before the first triton import to run them on cpu tensors).

Both read the (token, expert) pairs sorted by expert and padded so each BLOCK_M block of the
sorted axis belongs to one expert (`block_expert`; a padding slot holds the sentinel pair id
`num_pairs`, a block past the used ones the sentinel expert `num_experts`):

- `gate_up_kernel`: per (block, BLOCK_N columns): x rows of the block's tokens @ that expert's
  gate and up columns, then silu(gate) * up in the model dtype COMPUTE, stored at the block's
  sorted slots; with QUANT_OUT (the down experts are block fp8) quantized there per row as one
  activation group of BLOCK_N columns, its scale stored beside, so down reads fp8 and no
  separate quantizer runs over the padded slots.
- `down_kernel`: per (block, BLOCK_N columns): the block's activations @ the expert's down
  columns, times each pair's routing weight, stored at the pair's own row (token * top_k + j),
  so the top-k outputs of a token are summed afterwards without atomics.

W8A8 (block-FP8 experts, chip_child.models.fp8_experts): the activations come quantized to float8_e4m3fn
per row and group of BLOCK_K columns with their fp32 scales (a_scale [rows, groups]), the weights
as stored with one fp32 scale per (GROUP_N x BLOCK_K) block; each K step's fp8 dot is scaled by the
rows' activation scales and the columns' weight scales of that K block and accumulated in fp32
(vLLM's fused_moe with use_fp8_w8a8 and block_shape). BLOCK_K is then the weight block's column
count. Without W8A8 the scale pointers and strides are unused.

DOT_FP32 makes the plain matmuls take fp32 operands: only Triton's interpreter needs it (its bf16 dot
is wrong), as in the attention kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl

from chip_child.models.fp8_kernels import EPS, FP8_MAX, _round_to_e4m3


@triton.jit
def _dot_step(a, w, a_s_ptr, ws_ptr, scale_rows, kb, a_ok, col_ok, stride_ask, stride_wsk,
              W8A8: tl.constexpr, DOT_FP32: tl.constexpr):
    """One K step's product: plain, or fp8 scaled per K block (a_s_ptr: the rows' scale pointers,
    scale_rows: the columns' offsets of their weight-scale rows)."""
    if W8A8:
        a_s = tl.load(a_s_ptr + kb * stride_ask, mask=a_ok, other=0.0)
        w_s = tl.load(ws_ptr + scale_rows + kb * stride_wsk, mask=col_ok, other=0.0)
        step = tl.dot(a, w, out_dtype=tl.float32) * a_s[:, None] * w_s[None, :]
    else:
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        step = tl.dot(a, w)
    return step


@triton.jit
def gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, act_s_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs,
                   num_experts, hidden, inter, top_k, stride_x, stride_xsm, stride_xsk, stride_we, stride_wk, stride_wn,
                   stride_wse, stride_wsn, stride_wsk, stride_act, stride_act_sm, stride_act_sg,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                   W8A8: tl.constexpr, QUANT_OUT: tl.constexpr, DOT_FP32: tl.constexpr, COMPUTE: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ptr + slots)
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w_ptr + expert * stride_we
    ws = ws_ptr + expert * stride_wse
    x_s = xs_ptr + tokens * stride_xsm
    gate_scales = (cols // GROUP_N).to(tl.int64) * stride_wsn
    up_scales = ((cols + inter) // GROUP_N).to(tl.int64) * stride_wsn
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=wmask, other=0.0)
        wu = tl.load(w + ks[:, None] * stride_wk + (cols[None, :] + inter) * stride_wn, mask=wmask, other=0.0)
        kb = k0 // BLOCK_K
        gate += _dot_step(a, wg, x_s, ws, gate_scales, kb, valid, col_ok, stride_xsk, stride_wsk, W8A8, DOT_FP32)
        up += _dot_step(a, wu, x_s, ws, up_scales, kb, valid, col_ok, stride_xsk, stride_wsk, W8A8, DOT_FP32)
    dt = COMPUTE
    # Rounded where the torch reference rounds: the projection's output, silu, the product.
    g = gate.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    out = (s * up.to(dt).to(tl.float32)).to(dt)
    store_ok = valid[:, None] & col_ok[None, :]
    dest = act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :]
    if QUANT_OUT:
        # The tile's columns are one activation group (BLOCK_N == the down weight's block columns),
        # quantized as fp8_kernels.group_quant_kernel does (columns past `inter` are zeros).
        v = out.to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), 1), EPS), FP8_MAX)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(v, scale[:, None]), -FP8_MAX, FP8_MAX))
        tl.store(dest, q.to(act_ptr.dtype.element_ty), mask=store_ok)
        tl.store(act_s_ptr + slots.to(tl.int64) * stride_act_sm + tl.program_id(1) * stride_act_sg, scale, mask=valid)
    else:
        tl.store(dest, out, mask=store_ok)


@triton.jit
def down_kernel(act_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weight_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs,
                num_experts, hidden, inter, stride_act, stride_asm, stride_ask, stride_we, stride_wk, stride_wn,
                stride_wse, stride_wsn, stride_wsk, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, W8A8: tl.constexpr, DOT_FP32: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ptr + slots)
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w_ptr + expert * stride_we
    ws = ws_ptr + expert * stride_wse
    a_s = as_ptr + slots.to(tl.int64) * stride_asm
    scales = (cols // GROUP_N).to(tl.int64) * stride_wsn
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_act + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc += _dot_step(a, b, a_s, ws, scales, k0 // BLOCK_K, valid, col_ok, stride_ask, stride_wsk, W8A8, DOT_FP32)
    dt = out_ptr.dtype.element_ty
    rw = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = acc.to(dt).to(tl.float32) * rw[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], out.to(dt),
             mask=valid[:, None] & col_ok[None, :])
