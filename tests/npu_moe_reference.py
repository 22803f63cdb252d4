"""torch_npu's MoE ops in plain torch, from their documented semantics (a reference of the vendor
ops, not of our MoE), with the documented argument checks; tests/npu_reference.py puts them on
its stand-in torch_npu.

- npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx): x [N, E]
  (or [B, S, E]) float16 / bfloat16 / float32; softmax over the last axis, top-k values y (x's
  dtype) and their indices expert_idx (int32); row_idx = arange(N * k).reshape(k, N).T (int32);
  0 < k <= E, k <= 1024; a `finished` row (bool, shape x.shape[:-1]) gets expert id E.
- npu_moe_init_routing(x, row_idx, expert_idx, active_num) -> (expanded_x, expanded_row_idx,
  expanded_expert_idx): x [N, H]; row_idx and expert_idx int32 [N, K]; the pairs sorted by expert
  id (stable) give expanded_expert_idx and dst_to_src = row_idx.flat[order];
  expanded_row_idx[dst_to_src[i]] = i (int32 [N * K]); expanded_x[i] = x[dst_to_src[i] % N] for
  the first min(active_num, N) * K rows.
- npu_grouped_matmul(x, weight, *, group_list, group_type, group_list_type, split_item, ...) ->
  [y], modelled in the single-x, single-weight, single-y form grouped over M (group_type 0):
  x [[M, K]], weight [[E, K, N]], group_list int64 [E] (group_list_type 0: cumulative ends,
  non-decreasing, the last equal to M; 1: counts summing to M), split_item 2 or 3, at most 1024
  groups; rows of group i times weight[i]; x and weight of one float dtype, y too. The quantized
  forms, bias and the multi-tensor forms are not modelled.
- npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
  expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0, k=1) -> out [NUM_ROWS, H]:
  out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[k * NUM_ROWS + i]] +
  bias[expert_for_source_row[i, k]]); skip2 only with skip1; scales None takes k; rows [NUM_ROWS
  * K, H] in drop_pad_mode 0 (the dropless, column-ordered mode; the others not modelled), the
  other tensors of rows' dtype, src_to_dst int32 in [0, NUM_ROWS * K). Summed in fp32 here and
  cast to rows' dtype.
"""
from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    if x.dim() not in (2, 3) or x.dtype not in FLOATS:
        raise RuntimeError("x must be a 2D/3D float16, bfloat16 or float32 tensor")
    experts = x.shape[-1]
    if not 0 < k <= experts or k > 1024:
        raise RuntimeError(f"k must be in (0, {min(experts, 1024)}], got {k}")
    if finished is not None and (finished.dtype != torch.bool or finished.shape != x.shape[:-1]):
        raise RuntimeError("finished must be bool of shape x.shape[:-1]")
    y, idx = torch.softmax(x.float(), dim=-1).topk(k, dim=-1)
    idx = idx.to(torch.int32)
    if finished is not None:
        idx = torch.where(finished.unsqueeze(-1), torch.full_like(idx, experts), idx)
    rows = idx.view(-1, k).shape[0]
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t().reshape(idx.shape)
    return y.to(x.dtype), idx, row_idx


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    if x.dim() != 2 or x.dtype not in FLOATS:
        raise RuntimeError("x must be a 2D float16, bfloat16 or float32 tensor")
    if expert_idx.dim() != 2 or expert_idx.dtype != torch.int32 or row_idx.dtype != torch.int32:
        raise RuntimeError("row_idx and expert_idx must be int32 [NUM_ROWS, K]")
    if row_idx.shape != expert_idx.shape or expert_idx.shape[0] != x.shape[0]:
        raise RuntimeError("row_idx, expert_idx and x must agree on NUM_ROWS (and row_idx, expert_idx on K)")
    num_rows, k = expert_idx.shape
    order = expert_idx.flatten().argsort(stable=True)
    expanded_expert_idx = expert_idx.flatten()[order]
    dst_to_src = row_idx.flatten()[order].long()
    expanded_row_idx = torch.empty(num_rows * k, dtype=torch.int32, device=x.device)
    expanded_row_idx[dst_to_src] = torch.arange(num_rows * k, dtype=torch.int32, device=x.device)
    active = min(active_num, num_rows) * k
    return x[dst_to_src[:active] % num_rows], expanded_row_idx, expanded_expert_idx


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    quant = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
             activation_quant_scale, activation_quant_offset)
    if any(a is not None for a in quant) or act_type != 0 or output_dtype is not None:
        raise NotImplementedError("only the plain float form is modelled")
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError("only single x, single weight, single y grouped over M is modelled")
    a, w = x[0], weight[0]
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1]:
        raise RuntimeError("single-tensor grouping over M takes x [M, K] and weight [E, K, N]")
    if a.dtype not in FLOATS or a.dtype != w.dtype:
        raise RuntimeError("x and weight must share one float dtype")
    if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError("group_list must be a 1D int64 tensor")
    if group_list.numel() != w.shape[0] or group_list.numel() > 1024:
        raise RuntimeError("group_list needs one entry per weight group (at most 1024)")
    if group_list_type == 0:
        ends = group_list
        if (ends.diff() < 0).any() or (ends < 0).any() or ends[-1].item() != a.shape[0]:
            raise RuntimeError("group_list (cumulative) must be non-negative, non-decreasing and end at M")
    elif group_list_type == 1:
        if (group_list < 0).any() or group_list.sum().item() != a.shape[0]:
            raise RuntimeError("group_list (counts) must be non-negative and sum to M")
        ends = group_list.cumsum(0)
    else:
        raise NotImplementedError("group_list_type 2 is int8-only")
    y = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype, device=a.device)
    start = 0
    for i, end in enumerate(ends.tolist()):
        torch.mm(a[start:end], w[i], out=y[start:end])
        start = end
    return [y]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             expert_for_source_row, drop_pad_mode=0, k=1):
    rows = expanded_permuted_rows
    if drop_pad_mode != 0:
        raise NotImplementedError("only drop_pad_mode 0 (dropless, column-ordered) is modelled")
    if rows.dim() != 2 or rows.dtype not in FLOATS:
        raise RuntimeError("expanded_permuted_rows must be a 2D float16, bfloat16 or float32 tensor")
    if skip1 is None and skip2 is not None:
        raise RuntimeError("skip2 needs skip1")
    k = scales.shape[1] if scales is not None else k
    src_to_dst = expanded_src_to_dst_row
    if src_to_dst.dtype != torch.int32 or src_to_dst.dim() != 1 or src_to_dst.numel() % k:
        raise RuntimeError("expanded_src_to_dst_row must be int32 [NUM_ROWS * K]")
    num_rows, hidden = src_to_dst.numel() // k, rows.shape[1]
    if rows.shape[0] != num_rows * k:
        raise RuntimeError("expanded_permuted_rows must be [NUM_ROWS * K, H] in drop_pad_mode 0")
    if src_to_dst.numel() and (src_to_dst.min() < 0 or src_to_dst.max() >= num_rows * k):
        raise RuntimeError(f"expanded_src_to_dst_row values must lie in [0, {num_rows * k})")
    for name, t, shape in (("skip1", skip1, (num_rows, hidden)), ("skip2", skip2, (num_rows, hidden)),
                           ("scales", scales, (num_rows, k))):
        if t is not None and (t.dtype != rows.dtype or tuple(t.shape) != shape):
            raise RuntimeError(f"{name} must be {rows.dtype} of shape {list(shape)}")
    if bias is not None and (expert_for_source_row is None or expert_for_source_row.dtype != torch.int32
                             or tuple(expert_for_source_row.shape) != (num_rows, k)):
        raise RuntimeError("bias needs expert_for_source_row, int32 [NUM_ROWS, K]")
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=rows.device)
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.float()
    picked = rows.float()[src_to_dst.long().view(k, num_rows)]  # [K, NUM_ROWS, H]: pair j * NUM_ROWS + i
    if bias is not None:
        picked = picked + bias.float()[expert_for_source_row.long().t()]
    weights = scales.float().t().unsqueeze(-1) if scales is not None else 1.0
    return (out + (weights * picked).sum(0)).to(rows.dtype)


MOE_OPS = {f.__name__: f for f in (npu_moe_gating_top_k_softmax, npu_moe_init_routing, npu_grouped_matmul,
                                   npu_moe_finalize_routing)}
