"""Qwen3-MoE's sparse MLP on Ascend NPUs through torch_npu's MoE ops (chip_child.models.moe's interface:
`npu_moe(x, weights) -> y`); this module only plumbs. The calls, in order:

- ``npu_moe_gating_top_k_softmax(logits, None, k=top_k)`` -> (top-k softmax values, expert ids
  int32 [T, k], row ids int32 [T, k]: row_idx[t, j] = j * T + t). The router's logits go in as
  fp32, so the softmax and the renormalisation (done here with torch ops, as the op has none) are
  the reference's (chip_child.models.moe.route).
- ``npu_moe_init_routing(x, row_idx, expert_idx, active_num=T)`` -> (expanded_x [T * k, hidden]:
  the token rows grouped by expert, expanded_row_idx int32 [T * k]: where pair j * T + t landed,
  expanded_expert_idx int32: the sorted expert ids).
- ``npu_grouped_matmul([rows], [weight [E, K, N]], group_list=ends, group_type=0,
  group_list_type=0, split_item=2)`` -> [rows @ weight of each row's expert]: once with gate_up,
  once with down; `ends` (int64 [E]) is each expert's cumulative row count, taken from the
  sorted ids with one searchsorted.
- ``npu_moe_finalize_routing(down_rows, None, None, None, weights, expanded_row_idx, expert_idx,
  drop_pad_mode=0)`` -> sum over k of weight * that pair's row, per token.

SwiGLU between the two grouped matmuls is torch's silu and product, rounded as the reference
rounds. Under expert parallelism other ranks' experts sort last (id num_local); their rows are
cut before the grouped matmuls (the one host sync: how many rows are local) and come back as
zeros, so finalize adds nothing for them. Tested on the cpu against a stand-in torch_npu written
from the ops' documented semantics (tests/npu_moe_reference.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chip_child.models.moe import MoeWeights


def npu_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    import torch_npu

    tokens, hidden = x.shape
    if tokens == 0:
        return torch.zeros_like(x)
    logits = torch.mm(x, w.router).float()
    top, ids, row_idx = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=w.top_k)
    if w.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    weights = top.to(x.dtype)
    local = w.local_ids(ids).to(torch.int32)
    expanded_x, expanded_row_idx, sorted_ids = torch_npu.npu_moe_init_routing(x, row_idx, local, active_num=tokens)
    num_local = w.gate_up.shape[0]
    experts = torch.arange(num_local, dtype=sorted_ids.dtype, device=x.device)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int64)
    rows = expanded_x[:int(ends[-1])] if w.is_partial else expanded_x

    def grouped(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch_npu.npu_grouped_matmul([a], [weight], group_list=ends, group_type=0, group_list_type=0,
                                            split_item=2)[0]

    gate, up = grouped(rows, w.gate_up).chunk(2, -1)
    down = grouped(F.silu(gate) * up, w.down)
    if w.is_partial:
        down = torch.cat([down, down.new_zeros(expanded_x.shape[0] - down.shape[0], hidden)])
    return torch_npu.npu_moe_finalize_routing(down, None, None, None, weights, expanded_row_idx, ids,
                                              drop_pad_mode=0)
