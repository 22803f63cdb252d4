"""Triton kernels of the triton attention backend. Imported only when that backend is built, so
the rest of the package never needs triton (set TRITON_INTERPRET=1 before the first import to
run them on cpu tensors).

Cache of one layer, K or V: [pages, page_size, kv_heads, head_dim], contiguous, so slot s is
the row ``s * kv_heads * head_dim`` of a [slots, kv_heads * head_dim] matrix.

- `write_kv_kernel`: each program copies the K and V rows (every kv head) of BLOCK_T new
  tokens to their slots.
- `paged_attention_kernel`: one program per (sequence, block of that sequence's new tokens,
  kv head[, kv split]). Its rows are (token, query head of the group) pairs, so the query heads
  that share a kv head read each key tile once. It walks the sequence's keys in tiles of
  BLOCK_N positions, looking each position's page up in the block table (a tile may span pages;
  nothing is gathered), with the online softmax in fp32 (base 2). Causality: keys past the last
  token of the block are never read; the diagonal tile is masked per row.
- With NUM_SPLITS > 1 (flash-decoding) the keys of each sequence are cut into NUM_SPLITS
  ranges computed from its own length on the device; each program writes its normalised
  partial output and log-sum-exp, and `merge_splits_kernel` combines them per token, for
  BLOCK_H of its heads at a time.
- KV_FP8: the cache holds float8 e4m3 bytes (passed as uint8 views; the backend rounds K/V
  into them before the write kernel copies the bytes). Tiles are decoded to the query's dtype
  with integer ops (`e4m3_to_float`), exact, and the same on a GPU and under the interpreter,
  which has no float8 type.
- DOT_FP32 makes the matmuls take fp32 operands. Only Triton's interpreter needs it: its dot
  gives wrong results for bfloat16 operands (numpy has no bfloat16), so the backend sets it for
  bfloat16 caches on the cpu; on a GPU the dots take the cache dtype with fp32 accumulation.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens, stride_kt, stride_kh, stride_vt,
                    stride_vh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)  # (kv head, dim) flattened: one token's row of the cache
    h = c // HEAD_DIM
    d = c % HEAD_DIM
    mask = t_ok[:, None] & (c < NUM_KV_HEADS * HEAD_DIM)[None, :]
    dst = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + c[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def e4m3_to_float(bits):
    """float8 e4m3fn bytes (uint8) as float32, exactly: normal values move their exponent and
    mantissa into a float32's bit fields; subnormals are mantissa * 2^-9. The cache never holds
    NaN (writes saturate at 448)."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = (((b >> 7) << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    subnormal = tl.where((b >> 7) != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    split = tl.program_id(2) // NUM_KV_HEADS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = q_block * BLOCK_Q  # this program's first new token, counted within the sequence
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    position = context + token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token_row = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + token_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys up to the block's last token are all any of its rows can see.
    kv_end = context + tl.minimum(first + BLOCK_Q, q_len)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    else:
        lo = 0
        hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + cols
        key_ok = key_pos < hi
        page = tl.load(table + key_pos // PAGE_SIZE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + key_pos % PAGE_SIZE
        offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        if KV_FP8:
            k = e4m3_to_float(tl.load(k_cache_ptr + offs, mask=kv_mask, other=0)).to(q.dtype)
        else:
            k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((key_pos[None, :] <= position[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(s - base[:, None])
        alpha = tl.exp2(m_i - base)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            v = e4m3_to_float(tl.load(v_cache_ptr + offs, mask=kv_mask, other=0)).to(q.dtype)
        else:
            v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        part = token_row[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_out_ptr + part, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + token_row * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        dst = out_ptr + token_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_heads, stride_pt, stride_ph, stride_ps, stride_lt,
                        stride_lh, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    hs_ok = h_ok[:, None] & (sp < NUM_SPLITS)[None, :]
    lse = tl.load(part_lse_ptr + t * stride_lt + h[:, None] * stride_lh + sp[None, :], mask=hs_ok,
                  other=float("-inf"))  # [BLOCK_H, BLOCK_S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(hs_ok & (lse > float("-inf")), tl.exp2(lse - m[:, None]), 0.0)
    parts = tl.load(part_out_ptr + t * stride_pt + h[:, None, None] * stride_ph + sp[None, :, None] * stride_ps
                    + d[None, None, :], mask=hs_ok[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    total = tl.sum(w, 1)
    o = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d < HEAD_DIM)[None, :])


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)
