"""Our own fused MoE for cuda (chip_child.models.moe's interface: `triton_moe(x, weights) -> y`):
(token, expert) pairs sorted by expert and padded to BLOCK_M per expert, then block GEMMs whose
expert id is read per block (chip_child.models.moe_kernels). The layout is built with device ops of
fixed size (no host sync: the grid covers the worst-case padded length, and blocks past the
used ones exit at once), so a decode graph could capture it. Routing is the reference's
(chip_child.models.moe.route); under expert parallelism only this rank's experts run. Block-FP8 experts
kept as stored (chip_child.models.fp8_experts) run W8A8: each kernel's activations quantized per token
group first, the block scales applied inside the kernels' K loops. Tested on the cpu under
TRITON_INTERPRET=1 against `torch_moe`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chip_child.models.fp8 import FP8
from chip_child.models.fp8_experts import Fp8Experts
from chip_child.models.moe import MoeWeights, route

BLOCK_M = 16  # tl.dot's smallest tile
BLOCK_N = 32
BLOCK_K = 32


def _tl_dtypes() -> dict:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [padded_len] int64: the pair ids (token * k + j) grouped by expert, each
    expert's run padded to a multiple of block_m with the sentinel T * k; block_expert
    [padded_len / block_m] int32: each block's expert, num_experts past the used blocks).
    padded_len = T * k + num_experts * (block_m - 1), rounded up to block_m: the worst case."""
    flat = ids.flatten()
    pairs = flat.numel()
    padded_len = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    # scatter_add, not bincount: cuda's bincount reads the ids' maximum on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # each expert's first slot
    order = flat.argsort(stable=True)
    first_sorted = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    expert_of = flat[order]
    slot = starts[expert_of] + torch.arange(pairs, device=ids.device) - first_sorted[expert_of]
    sorted_pairs = torch.full((padded_len,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[slot] = order
    ends = torch.cumsum(padded, 0)
    block_starts = torch.arange(0, padded_len, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)  # == num_experts past the end
    return sorted_pairs, block_expert


@dataclass
class _Operands:
    """One kernel's activations and expert weights as its arguments: plain ([experts, in, out] at
    its strides), or W8A8 (the activations quantized per group, the weights' [experts, out, in]
    read through swapped strides, their block scales; chip_child.models.fp8_experts)."""

    a: torch.Tensor
    a_scale: torch.Tensor  # [rows, groups] fp32; unused (a itself) when plain
    w: torch.Tensor
    w_scale: torch.Tensor  # [experts, out blocks, in blocks] fp32; unused (w itself) when plain
    w_strides: tuple[int, int, int]  # expert, k (in), n (out)
    group_n: int  # the weight block's rows
    block_k: int
    w8a8: bool

    @classmethod
    def of(cls, a: torch.Tensor, w: "torch.Tensor | Fp8Experts", a_scale: torch.Tensor | None = None) -> "_Operands":
        """`a_scale`: a's scales where a comes quantized (the fused MoE's own activations)."""
        if isinstance(w, Fp8Experts):
            if a_scale is None:
                from chip_child.models.fp8_linear import quantize_activations

                a, a_scale = quantize_activations(a, w.block[1])
            se, sn, sk = w.weight.stride()
            return cls(a, a_scale, w.weight, w.scale_inv, (se, sk, sn), w.block[0], w.block[1], True)
        return cls(a, a, w, w, tuple(w.stride()), 1, BLOCK_K, False)

    def args(self) -> tuple:
        """a, its scales, w, its scales: the kernels' pointer arguments."""
        return self.a, self.a_scale, self.w, self.w_scale

    def strides(self) -> tuple:
        """a's row stride, a_scale's, w's and w_scale's: the kernels' stride arguments after the sizes."""
        a_scale = self.a_scale.stride() if self.w8a8 else (0, 0)
        w_scale = self.w_scale.stride() if self.w8a8 else (0, 0, 0)
        return (self.a.stride(0), *a_scale, *self.w_strides, *w_scale)

    def meta(self, dot_fp32: bool, block_n: int = BLOCK_N) -> dict:
        return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=self.block_k, GROUP_N=self.group_n, W8A8=self.w8a8,
                    DOT_FP32=dot_fp32 and not self.w8a8)


def triton_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    from chip_child.models import moe_kernels as k

    tokens, hidden = x.shape
    num_experts, _, two_inter = w.gate_up.shape
    inter = two_inter // 2
    if tokens == 0:
        return torch.zeros_like(x)
    weights, ids = route(x, w)
    # Expert parallel: another rank's pairs gather under one more expert id, whose blocks the
    # kernels skip (>= num_experts), so their rows of `out` stay zero.
    sorted_pairs, block_expert = align_by_expert(w.local_ids(ids), num_experts + w.is_partial)
    pairs = ids.numel()
    blocks = block_expert.numel()
    dot_fp32 = x.device.type == "cpu" and x.dtype != torch.float32  # only the interpreter runs on the cpu
    # Block-fp8 down experts: gate_up stores its output quantized, one activation group per tile.
    quant_act = isinstance(w.down, Fp8Experts)
    block_n = w.down.block[1] if quant_act else BLOCK_N
    act = torch.empty((sorted_pairs.numel(), inter), dtype=FP8 if quant_act else x.dtype, device=x.device)
    act_scale = (torch.empty((sorted_pairs.numel(), -(-inter // block_n)), dtype=torch.float32, device=x.device)
                 if quant_act else act)
    first = _Operands.of(x, w.gate_up)
    k.gate_up_kernel[(blocks, -(-inter // block_n))](
        *first.args(), act, act_scale, sorted_pairs, block_expert, pairs, num_experts, hidden, inter, w.top_k,
        *first.strides(), act.stride(0), *(act_scale.stride() if quant_act else (0, 0)),
        **first.meta(dot_fp32, block_n), QUANT_OUT=quant_act, COMPUTE=_tl_dtypes()[x.dtype])
    out = (torch.zeros if w.is_partial else torch.empty)((pairs, hidden), dtype=x.dtype, device=x.device)
    second = _Operands.of(act, w.down, act_scale if quant_act else None)
    k.down_kernel[(blocks, -(-hidden // BLOCK_N))](
        *second.args(), out, weights.flatten(), sorted_pairs, block_expert, pairs, num_experts, hidden, inter,
        *second.strides(), out.stride(0), **second.meta(dot_fp32))
    return out.view(tokens, w.top_k, hidden).sum(1)
