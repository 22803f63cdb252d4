"""A stand-in `torch_npu` for machines without an NPU: the three ops the npu attention backend
calls, written in plain torch from their documented semantics (a reference of the vendor ops,
not of our backend), with the documented argument checks; and the MoE ops of
chip_child.models.moe_npu, from tests/npu_moe_reference.py.

- npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
  compress_seq_offsets=None, seq_lens=None): key/value [T, N, D], caches [blocks, block_size, N, D];
  every input contiguous; one dtype for key, value and caches; slot_mapping int32 or int64 in
  [0, blocks * block_size); a slot named twice holds an unspecified value afterwards (here a
  large sentinel, so a reader of such a slot shows up in comparisons).
- _npu_reshape_and_cache(key=, value=, key_cache=, value_cache=, slot_indices=): the same write
  with int32 slot indices (the older op).
- npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths,
  actual_seq_lengths_kv, block_table, num_heads, scale, input_layout, num_key_value_heads,
  sparse_mode, block_size, ...) -> (attention_out, softmax_lse), in its paged form (block_table
  given): key/value are the caches [blocks, block_size, kv_heads * D] (or [blocks, kv_heads,
  block_size, D]), block_table int32 [B, >= blocks of the longest sequence],
  actual_seq_lengths_kv is required, one length per sequence.
  - input_layout "BSH": query [B, S, heads * D]; with S == 1 every query sees all of its
    sequence's actual_seq_lengths_kv keys (sparse_mode has no effect).
  - input_layout "TND": query [T, heads, D]; actual_seq_lengths is required, its values are
    cumulative (each the sum of this and all earlier sequences' query lengths, non-decreasing)
    and its count is B; sparse_mode is 0 without a mask (no masking) or 3 with the optimised
    2048 x 2048 lower-triangular mask (rightDownCausal: query i of a sequence sees key j when
    j <= i + kv_len - q_len).
  - query float16 or bfloat16, contiguous; num_heads a multiple of num_key_value_heads (0 means
    equal), at most 64 query heads per kv head; block_size a multiple of 16, and when any query
    length exceeds 1, a multiple of 128 between 128 and 512.
  Scores are computed in fp32; the output has query's shape (D of value) and dtype; the lse
  output is a 1-element zero tensor when softmax_lse_flag is False.
"""
from __future__ import annotations

import types

import torch

from npu_moe_reference import MOE_OPS

SENTINEL = 8192.0  # exact in float16 and bfloat16


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")


def _scatter(key, value, key_cache, value_cache, slots) -> None:
    _check_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise RuntimeError("key/value must be [T, N, D] and the caches [blocks, block_size, N, D]")
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise RuntimeError("key, value, key_cache and value_cache must share one dtype")
    if key.shape[:2] != value.shape[:2] or slots.shape != (key.shape[0],):
        raise RuntimeError("key, value and slot_mapping must agree on T (and key, value on N)")
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise RuntimeError("cache [blocks, block_size, N, D] does not match key/value [T, N, D]")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    idx = slots.to(torch.int64)
    if idx.numel() and (idx.min() < 0 or idx.max() >= capacity):
        raise RuntimeError(f"slot_mapping values must lie in [0, {capacity})")
    for cache, src in ((key_cache, key), (value_cache, value)):
        flat = cache.view(-1, *cache.shape[2:])
        flat[idx] = src
        uniq, counts = idx.unique(return_counts=True)
        flat[uniq[counts > 1]] = SENTINEL


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None):
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("slot_mapping must be int32 or int64")
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("the compressed scenario is not modelled")
    _scatter(key, value, key_cache, value_cache, slot_mapping)


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    if slot_indices.dtype != torch.int32:
        raise RuntimeError("slot_indices must be int32")
    _scatter(key, value, key_cache, value_cache, slot_indices)


def _paged_keys(cache: torch.Tensor, pages: torch.Tensor, kv_len: int, kv_heads: int, block_size: int) -> torch.Tensor:
    """[kv_len, kv_heads, D] of one sequence from a [blocks, block_size, H] or [blocks, kv_heads,
    block_size, D] cache."""
    need = -(-kv_len // block_size)
    if cache.dim() == 3:
        rows = cache[pages[:need].long()].reshape(need * block_size, kv_heads, -1)
    else:
        rows = cache[pages[:need].long()].transpose(1, 2).reshape(need * block_size, kv_heads, -1)
    return rows[:kv_len]


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **unused):
    for name, arg in unused.items():
        if arg is not None and name not in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
            raise NotImplementedError(f"{name} is not modelled")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"query dtype {query.dtype} is not supported (float16, bfloat16)")
    _check_contiguous(query=query, key=key, value=value)
    if pse_shift is not None:
        raise NotImplementedError("pse_shift is not modelled")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads or num_heads // kv_heads > 64:
        raise RuntimeError("num_heads must be a multiple of num_key_value_heads, at most 64 times it")
    if block_table is None:
        raise NotImplementedError("only the paged form (block_table given) is modelled")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise RuntimeError("block_table must be a 2-D int32 tensor")
    if key.shape != value.shape or key.dim() not in (3, 4):
        raise RuntimeError("paged key/value must share a shape [blocks, block_size, H] or [blocks, N, block_size, D]")
    cache_block = key.shape[1] if key.dim() == 3 else key.shape[2]
    if block_size != cache_block or block_size % 16:
        raise RuntimeError(f"block_size={block_size} must equal the caches' block size and be a multiple of 16")
    if actual_seq_lengths_kv is None:
        raise RuntimeError("page attention needs actual_seq_lengths_kv")
    kv_lens = [int(x) for x in actual_seq_lengths_kv]

    if input_layout == "BSH":
        b, s_q, hidden = query.shape
        head_dim = hidden // num_heads
        q = query.view(b, s_q, num_heads, head_dim)
        q_lens = [s_q] * b
        if s_q > 1:
            raise NotImplementedError("BSH is modelled for decode (S == 1) only")
    elif input_layout == "TND":
        t, n, head_dim = query.shape
        if n != num_heads:
            raise RuntimeError("TND query's N must equal num_heads")
        if actual_seq_lengths is None:
            raise RuntimeError("TND needs actual_seq_lengths")
        ends = [int(x) for x in actual_seq_lengths]
        if any(e1 < e0 for e0, e1 in zip([0] + ends[:-1], ends)) or (ends and ends[-1] > t):
            raise RuntimeError("TND actual_seq_lengths must be non-decreasing cumulative sums within T")
        b = len(ends)
        q_lens = [e1 - e0 for e0, e1 in zip([0] + ends[:-1], ends)]
        q = query
    else:
        raise NotImplementedError(f"input_layout {input_layout!r} is not modelled")
    if len(kv_lens) < b:
        raise RuntimeError("actual_seq_lengths_kv needs one length per sequence")
    if block_table.shape[0] != b:
        raise RuntimeError(f"block_table's first dimension must equal the batch {b}")
    if max(q_lens, default=0) > 1 and (block_size % 128 or not 128 <= block_size <= 512):
        raise RuntimeError(f"block_size={block_size}: page attention with query length > 1 needs a multiple of 128 "
                           "in [128, 512]")
    max_blocks = max((-(-kl // block_size) for kl in kv_lens[:b]), default=0)
    if block_table.shape[1] < max_blocks:
        raise RuntimeError("block_table's second dimension is below the longest sequence's block count")
    causal = False
    if input_layout == "TND":
        if sparse_mode == 3:
            if atten_mask is None or tuple(atten_mask.shape[-2:]) != (2048, 2048) or atten_mask.dtype not in (
                    torch.bool, torch.int8, torch.uint8):
                raise RuntimeError("sparse_mode=3 needs the optimised 2048 x 2048 mask")
            expected = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=atten_mask.device), 1)
            if not torch.equal(atten_mask.reshape(2048, 2048).bool(), expected):
                raise RuntimeError("the optimised mask must be 1 strictly above the diagonal, 0 elsewhere")
            causal = True
        elif sparse_mode != 0 or atten_mask is not None:
            raise RuntimeError("TND takes sparse_mode=0 without a mask or sparse_mode=3 with one")
    group = num_heads // kv_heads

    if (value.shape[-1] if value.dim() == 4 else value.shape[-1] // kv_heads) != head_dim:
        raise NotImplementedError("a value head size different from the query's is not modelled")
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    token = 0
    for i in range(b):
        ql, kl = q_lens[i], kv_lens[i]
        if ql == 0:
            continue
        keys = _paged_keys(key, block_table[i], kl, kv_heads, block_size).float()  # [kl, kvh, D]
        vals = _paged_keys(value, block_table[i], kl, kv_heads, block_size).float()
        qi = (q[i] if input_layout == "BSH" else q[token:token + ql]).float()  # [ql, heads, D]
        keys = keys.repeat_interleave(group, 1)
        vals = vals.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        if causal:
            allowed = torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql)
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(query.dtype)
        if input_layout == "BSH":
            out[i] = o.reshape(ql, -1)
        else:
            out[token:token + ql] = o
        token += ql
    lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out, lse


def fake_torch_npu(with_scatter: bool = True) -> types.ModuleType:
    """A module to install as sys.modules["torch_npu"]; `with_scatter=False` models a release
    that only has _npu_reshape_and_cache."""
    mod = types.ModuleType("torch_npu")
    mod.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    mod._npu_reshape_and_cache = _npu_reshape_and_cache
    if with_scatter:
        mod.npu_scatter_pa_kv_cache = npu_scatter_pa_kv_cache
    for name, fn in MOE_OPS.items():
        setattr(mod, name, fn)
    mod.calls = []
    for name in ("npu_fused_infer_attention_score", "_npu_reshape_and_cache", "npu_scatter_pa_kv_cache", *MOE_OPS):
        fn = getattr(mod, name, None)
        if fn is not None:
            setattr(mod, name, _recorded(mod.calls, name, fn))
    return mod


def _recorded(calls: list, name: str, fn):
    def call(*args, **kwargs):
        calls.append((name, kwargs))
        return fn(*args, **kwargs)

    return call
