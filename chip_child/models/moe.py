"""Qwen3-MoE's sparse MLP: the config, one layer's expert weights, and the implementations behind
one interface (as attention has): `MoeImpl(x, weights) -> y`.

Routing is transformers' Qwen3MoeTopKRouter: router logits in the model dtype, softmax in fp32,
top-k, renormalised to sum to one when `norm_topk_prob`, cast back to the model dtype. Each chosen
expert is a SwiGLU MLP whose output is weighted by its routing weight and summed per token.

`torch_moe`, the reference and the cpu path, groups the (token, expert) pairs by expert with one
sort and runs each expert that received tokens as two matmuls over its contiguous slice: a loop
over experts, never over tokens. It reads the per-expert counts on the host, so it cannot be
captured in a device graph.

Tensor parallelism shards each expert's intermediate dimension (as the dense MLP's): every rank
routes all tokens with the full router and returns a partial sum that the layer's all-reduce
completes. Expert parallelism (`enable_expert_parallel`) splits the experts instead: a rank holds
num_experts / world experts whole (`MoeWeights.first_expert` on), routes all tokens with the full
router, runs only the (token, expert) pairs of its own experts and leaves the others' rows zero,
and the same all-reduce sums the ranks' outputs. Tokens are replicated across the ranks in this
runtime, so that is the whole dispatch: no all-to-all, at the price of every rank routing every
token and an all-reduce of the full hidden states (the one TP already does).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from chip_child.models.fp8_experts import Fp8Experts, expert_stack
from chip_child.models.quant import BlockFp8


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size: each expert's (this rank's share under TP)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE; the others are dense


def parse_moe(raw: dict[str, Any], num_layers: int, path: Path) -> MoeConfig:
    """Qwen3MoeConfig's fields; a layer is sparse unless listed in `mlp_only_layers`, and only
    every `decoder_sparse_step`-th (transformers' rule: (i + 1) % step == 0)."""
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts")) or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    inter = raw.get("moe_intermediate_size")
    if num_experts <= 0 or not 0 < top_k <= num_experts or not inter:
        raise ValueError(f"{path}: a MoE config needs num_experts > 0, 0 < num_experts_per_tok <= num_experts and "
                         f"moe_intermediate_size; got {num_experts}, {top_k}, {inter}")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeConfig(num_experts, top_k, int(inter), bool(raw.get("norm_topk_prob", False)), sparse)


def expert_tensor_shapes(prefix: str, moe: MoeConfig, hidden: int) -> dict[str, tuple[int, ...]]:
    """HF names -> shapes of one sparse layer's MLP (`prefix` is "model.layers.{i}.mlp.")."""
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (moe.num_experts, hidden)}
    inter = moe.intermediate_size
    for e in range(moe.num_experts):
        p = f"{prefix}experts.{e}."
        shapes[p + "gate_proj.weight"] = (inter, hidden)
        shapes[p + "up_proj.weight"] = (inter, hidden)
        shapes[p + "down_proj.weight"] = (hidden, inter)
    return shapes


@dataclass
class MoeWeights:
    """One sparse layer. Stored for `x @ w` like the dense projections: router [hidden, experts]
    (always all of them), gate_up [local experts, hidden, 2 * inter] (gate then up), down
    [local experts, inter, hidden]; the local experts are first_expert, first_expert + 1, ...
    (all of them unless expert parallel)."""

    router: torch.Tensor
    gate_up: torch.Tensor | Fp8Experts  # Fp8Experts: block fp8 kept as stored (cuda; chip_child.models.fp8_experts)
    down: torch.Tensor | Fp8Experts
    top_k: int
    norm_topk_prob: bool
    first_expert: int = 0

    @classmethod
    def from_hf(cls, state: dict[str, torch.Tensor], prefix: str, moe: MoeConfig, inter: slice,
                experts: slice | None = None, quant: BlockFp8 | None = None) -> "MoeWeights":
        """`inter`: this rank's slice of every expert's intermediate dimension; `experts`: the
        experts it holds (None: all); `quant`: the checkpoint's block fp8, whose kept tensors stay fp8."""
        experts = experts or slice(0, moe.num_experts)
        names = [f"{prefix}experts.{e}." for e in range(experts.start, experts.stop)]
        every, dtype = slice(None), state[prefix + "gate.weight"].dtype
        gate_up = expert_stack(state, [[(p + "gate_proj.weight", inter, every), (p + "up_proj.weight", inter, every)]
                                       for p in names], quant, dtype)
        down = expert_stack(state, [[(p + "down_proj.weight", every, inter)] for p in names], quant, dtype)
        return cls(router=state[prefix + "gate.weight"].t(), gate_up=gate_up, down=down, top_k=moe.top_k,
                   norm_topk_prob=moe.norm_topk_prob, first_expert=experts.start)

    @property
    def is_partial(self) -> bool:
        """Holds only some of the experts (expert parallel)."""
        return self.gate_up.shape[0] < self.router.shape[1]

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids -> this rank's expert index, num_local for another rank's expert."""
        if not self.is_partial:
            return ids
        n = self.gate_up.shape[0]
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < n), local, n)

    def to(self, device: torch.device) -> "MoeWeights":
        return replace(self, router=self.router.to(device), gate_up=self.gate_up.to(device),
                       down=self.down.to(device))


MoeImpl = Callable[[torch.Tensor, MoeWeights], torch.Tensor]  # x [T, hidden] -> y [T, hidden]


def route(x: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k] int64): softmax over the router's logits in
    fp32, top-k, renormalised when norm_topk_prob."""
    probs = torch.softmax(torch.mm(x, w.router), dim=-1, dtype=torch.float32)
    top, ids = probs.topk(w.top_k, dim=-1)
    if w.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return top.to(x.dtype), ids


def _expert_mm(x: torch.Tensor, weights: torch.Tensor | Fp8Experts, expert: int) -> torch.Tensor:
    return torch.mm(x, weights[expert]) if isinstance(weights, torch.Tensor) else weights.mm(x, expert)


def torch_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """The reference: (token, expert) pairs sorted by expert, one SwiGLU per expert over its slice.
    Pairs of other ranks' experts (expert parallel) sort last and are left out. Block-FP8 experts
    (chip_child.models.fp8_experts) run their W8A8 math in torch ops: the fused MoE's reference."""
    weights, ids = route(x, w)
    k = w.top_k
    flat = w.local_ids(ids).flatten()
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
    num_local = w.gate_up.shape[0]
    counts = torch.bincount(flat, minlength=num_local).tolist()[:num_local]
    order = order[:sum(counts)] if w.is_partial else order
    tokens = order // k
    xs = x.index_select(0, tokens)
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            gate, up = _expert_mm(xs[start:start + n], w.gate_up, expert).chunk(2, -1)
            ys[start:start + n] = _expert_mm(F.silu(gate) * up, w.down, expert)
            start += n
    ys *= weights.flatten().index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, ys)
