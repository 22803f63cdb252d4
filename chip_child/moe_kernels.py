"""Triton kernels of the fused MoE (chip_child.moe_triton). Imported only when used (set
TRITON_INTERPRET=1 before the first triton import to run them on cpu tensors).

Both read the (token, expert) pairs sorted by expert and padded so each BLOCK_M block of the
sorted axis belongs to one expert (`block_expert`; a padding slot holds the sentinel pair id
`num_pairs`, a block past the used ones the sentinel expert `num_experts`):

- `gate_up_kernel`: per (block, BLOCK_N columns): x rows of the block's tokens @ that expert's
  gate and up columns, then silu(gate) * up, stored at the block's sorted slots.
- `down_kernel`: per (block, BLOCK_N columns): the block's activations @ the expert's down
  columns, times each pair's routing weight, stored at the pair's own row (token * top_k + j),
  so the top-k outputs of a token are summed afterwards without atomics.

DOT_FP32 makes the matmuls take fp32 operands: only Triton's interpreter needs it (its bf16 dot
is wrong), as in the attention kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs, num_experts, hidden, inter,
                   top_k, stride_x, stride_we, stride_wk, stride_wn, stride_act,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
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
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=wmask, other=0.0)
        wu = tl.load(w + ks[:, None] * stride_wk + (cols[None, :] + inter) * stride_wn, mask=wmask, other=0.0)
        if DOT_FP32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate += tl.dot(a, wg)
        up += tl.dot(a, wu)
    dt = act_ptr.dtype.element_ty
    # Rounded where the torch reference rounds: the projection's output, silu, the product.
    g = gate.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    out = s * up.to(dt).to(tl.float32)
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :], out.to(dt),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(act_ptr, w_ptr, out_ptr, weight_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs, num_experts,
                hidden, inter, stride_act, stride_we, stride_wk, stride_wn, stride_out,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
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
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_act + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b)
    dt = out_ptr.dtype.element_ty
    rw = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = acc.to(dt).to(tl.float32) * rw[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], out.to(dt),
             mask=valid[:, None] & col_ok[None, :])
