"""Qwen3 as transformers defines it, as plain functions over a packed token axis; the families
that differ from it only in configuration (ModelConfig: Qwen2's q/k/v biases, no q/k norm in
Llama, Qwen2 and Mistral, Llama 3's RoPE scaling) run the same functions, and so does Qwen3-MoE,
whose sparse layers take their MLP from chip_child.models.moe.

Weights are fused once at load (q/k/v into one matrix, gate/up into another) so a layer is four
matmuls. One forward serves every step: decode rows (one token each) and prefill chunks sit side
by side on the token axis, and attention over the paged KV cache is the attention backend's
(chip_child.attention): K/V written by slot mapping, read through the block table, no dense
mask built on the host. On the cpu the projections and the lm_head can be prepacked for oneDNN
at load (chip_child.models.prepack); on cuda block-FP8 projections stay fp8 (chip_child.models.fp8_linear, chip_child.models.fp8_experts);
`linear` takes any kind of weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from chip_child.attention import AttentionBackend, StepPlan
from chip_child.models.fp8_linear import Fp8Linear, projection
from chip_child.models.loader import ModelConfig, shard_slice
from chip_child.models.moe import MoeImpl, MoeWeights, torch_moe
from chip_child.models.prepack import PackedLinear, prepacked
from chip_child.models.rope import inv_freq

if TYPE_CHECKING:
    from chip_child.models.lora import LoraStep

Weight = torch.Tensor | PackedLinear | Fp8Linear  # a plain [in, out] view, prepacked, or block fp8 (cuda)


@dataclass
class LayerWeights:
    """One layer's tensors. Projections are stored transposed ([in, out] views of the checkpoint's
    [out, in] tensors), so each is a single mm with no per-step transpose; or prepacked."""

    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    # [heads + kv_heads, head_dim]: q_norm per query head, then k_norm per kv head; None: no q/k norm
    qk_norm: torch.Tensor | None
    o_proj: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight | None  # the dense MLP; None in a sparse (MoE) layer
    down: Weight | None
    moe: MoeWeights | None = None  # a sparse layer's router and experts


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class Qwen3Weights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Weight  # [hidden, vocab]; a view of embed when the embeddings are tied
    tied: bool
    # 0-dim constants of the norms: a python float would be wrapped into a tensor on every op.
    eps: torch.Tensor
    inv_hidden: torch.Tensor
    inv_head_dim: torch.Tensor
    eps_value: float  # rms_norm_eps as a python float, for kernels that take it as an argument

    @classmethod
    def from_hf(cls, state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int = 0,
                world: int = 1, expert_parallel: bool = False) -> "Qwen3Weights":
        """Fuses the HF tensors; with world > 1 keeps this rank's tensor-parallel shard: its
        slice of the heads and of the MLP's intermediate dimension (Megatron-style; each
        expert's in a MoE layer, or with `expert_parallel` its num_experts / world experts
        whole), with o_proj and down_proj split by input so one all-reduce after each completes
        the layer."""
        layers = [layer_from_hf(state, cfg, i, rank, world, expert_parallel) for i in range(cfg.num_layers)]
        hd = cfg.head_dim
        embed = state["model.embed_tokens.weight"]
        tied = cfg.tie_word_embeddings
        scalar = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        return cls(embed=embed, layers=layers, norm=state["model.norm.weight"],
                   lm_head=(embed if tied else state["lm_head.weight"]).t(), tied=tied,
                   eps=scalar(cfg.rms_norm_eps), inv_hidden=scalar(1 / cfg.hidden_size),
                   inv_head_dim=scalar(1 / hd), eps_value=float(cfg.rms_norm_eps))

    def to(self, device: torch.device) -> "Qwen3Weights":
        # Tensor.to keeps the transposed strides, so the moved projections are still [in, out] views.
        to = lambda t: None if t is None else t.to(device)  # noqa: E731  (MoeWeights has .to too)
        layers = [layer_to(lw, device) for lw in self.layers]
        embed = to(self.embed)
        return Qwen3Weights(embed=embed, layers=layers, norm=to(self.norm),
                            lm_head=embed.t() if self.tied else to(self.lm_head), tied=self.tied,
                            eps=to(self.eps), inv_hidden=to(self.inv_hidden), inv_head_dim=to(self.inv_head_dim),
                            eps_value=self.eps_value)

    def held_experts(self) -> list[int] | None:
        """[first, count] of the experts this rank holds (all unless expert parallel); None: no MoE."""
        moe = next((lw.moe for lw in self.layers if lw.moe is not None), None)
        return None if moe is None else [moe.first_expert, moe.gate_up.shape[0]]

    def prepack(self) -> None:
        """Replaces the projections and the lm_head by their oneDNN-prepacked copies (small ones
        stay plain: chip_child.models.prepack), in place and one matrix at a time, so loading peaks at one
        plain matrix above the packed model. A tied lm_head's packed copy is extra memory: the
        embedding keeps the plain one."""
        for lw in self.layers:
            prepack_layer(lw)
        self.lm_head = prepacked(self.lm_head)



def layer_to(lw: LayerWeights, device: torch.device) -> LayerWeights:
    return LayerWeights(**{k: None if v is None else v.to(device) for k, v in vars(lw).items()})


def prepack_layer(lw: LayerWeights) -> None:
    for name in PROJECTIONS:
        if getattr(lw, name) is not None:  # a sparse layer's experts stay plain (chip_child.models.moe)
            setattr(lw, name, prepacked(getattr(lw, name)))


def layer_from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, i: int, rank: int = 0, world: int = 1,
                  expert_parallel: bool = False) -> LayerWeights:
    """Layer `i` of Qwen3Weights.from_hf: its HF tensors fused, this rank's shard (weight updates
    rebuild one layer at a time with it)."""
    hd = cfg.head_dim
    heads = shard_slice(rank, world, cfg.num_heads * hd)
    kv_heads = shard_slice(rank, world, cfg.num_kv_heads * hd)
    inter = shard_slice(rank, world, cfg.intermediate_size)
    moe = cfg.moe
    expert_inter = experts = None
    if moe is not None:
        expert_inter = slice(None) if expert_parallel else shard_slice(rank, world, moe.intermediate_size)
        experts = shard_slice(rank, world, moe.num_experts) if expert_parallel else slice(0, moe.num_experts)
    every = slice(None)
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    dtype = state[p + "input_layernorm.weight"].dtype  # the compute dtype
    proj = lambda parts: projection(state, parts, cfg.quantization, dtype)  # noqa: E731
    rows = {"q": heads, "k": kv_heads, "v": kv_heads}
    qkv_bias = torch.cat([state[attn + f"{n}_proj.bias"][rows[n]] for n in "qkv"]) if cfg.qkv_bias else None
    # Added by one rank only, so the all-reduce sums it in once.
    o_bias = state[attn + "o_proj.bias"] if cfg.o_bias and rank == 0 else None
    sparse = moe is not None and i in moe.sparse_layers
    qk_norm = None
    if cfg.qk_norm:
        qk_norm = torch.cat([state[attn + "q_norm.weight"].expand(cfg.num_heads // world, hd),
                             state[attn + "k_norm.weight"].expand(cfg.num_kv_heads // world, hd)])
    return LayerWeights(
        input_norm=state[p + "input_layernorm.weight"],
        qkv=proj([(attn + f"{n}_proj.weight", rows[n], every) for n in "qkv"]),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o_proj=proj([(attn + "o_proj.weight", every, heads)]),
        o_bias=o_bias,
        post_norm=state[p + "post_attention_layernorm.weight"],
        gate_up=None if sparse else proj([(p + f"mlp.{n}_proj.weight", inter, every) for n in ("gate", "up")]),
        down=None if sparse else proj([(p + "mlp.down_proj.weight", every, inter)]),
        moe=MoeWeights.from_hf(state, p + "mlp.", moe, expert_inter, experts, cfg.quantization) if sparse else None,
    )

def shard_config(cfg: ModelConfig, world: int, expert_parallel: bool = False) -> ModelConfig:
    """The per-rank view of the model under tensor parallelism over `world` devices; with
    `expert_parallel` a MoE layer's experts are split across the ranks instead of each expert's
    intermediate dimension (the view keeps the full router: every rank routes every token)."""
    sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size)]
    if expert_parallel:
        if cfg.moe is None:
            raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts (only MoE models do)")
        if world < 2:
            raise ValueError("enable_expert_parallel splits the experts across tensor-parallel ranks: it needs "
                             f"more than one device in device_ids, got {world}")
        sizes.append(("num_experts", cfg.moe.num_experts))
    elif cfg.moe is not None:
        sizes.append(("moe_intermediate_size", cfg.moe.intermediate_size))
    for name, value in sizes:
        if value % world:
            raise ValueError(f"device_ids: {world} devices do not divide the model's {name}={value}"
                             f"{' (enable_expert_parallel)' if name == 'num_experts' else ''}")
    moe = cfg.moe and (cfg.moe if expert_parallel else
                       replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // world))
    return replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                   intermediate_size=cfg.intermediate_size // world, moe=moe)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, inv_dim: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: normalised in fp32, cast back, then scaled by the weight.
    Written out with 0-dim constants: F.rms_norm's cpu composite runs twice as many ops."""
    h = x if x.dtype == torch.float32 else x.float()
    h = h * torch.rsqrt(torch.addcmul(eps, (h * h).sum(-1, keepdim=True), inv_dim))
    return weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def linear(x: torch.Tensor, weight_t: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight_t [in, out] (+ bias): one mm, or one call of the prepacked or fp8 layer."""
    if type(weight_t) is PackedLinear or type(weight_t) is Fp8Linear:
        return weight_t(x, bias)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def rope_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_len, 2, head_dim]: cos and sign-folded sin of every position, computed in fp32 then
    cast like transformers, side by side so one index_select fetches both. The sin row carries
    rotate-half's minus sign on its first half, so apply_rope needs a roll instead of a
    negate-and-concatenate."""
    hd = cfg.head_dim
    freq = inv_freq(cfg.rope_theta, hd, cfg.rope_scaling)  # scaled as the config says
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    return torch.stack([emb.cos().to(dtype), emb.sin().to(dtype) * sign.to(dtype)], dim=1).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos, signed_sin: [T, 1, hd] (rows of the rope table)."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1]; the sign lives in signed_sin
    return x * cos + rotated * signed_sin


@dataclass(frozen=True)
class LayerOps:
    """The elementwise stages of a layer. TORCH_OPS, the reference, runs them as torch ops on
    every device; chip_child.models.fused has one Triton kernel per stage for cuda.

    add_rms_norm(h, delta, weight, w) -> (h + delta, rms_norm(h + delta)); delta None: (h, rms_norm(h))
    rope_rows(rope, positions) -> what qk_norm_rope reads the step's rotations from
    qk_norm_rope(qk, weight, rows, w) -> qk [T, heads + kv_heads, hd] normed per head (weight None:
        not normed, as Llama, Qwen2 and Mistral have no q/k norm) and rotated
    silu_mul(gate_up) -> silu(gate) * up
    moe(x, moe_weights) -> a sparse layer's MLP output (chip_child.models.moe.MoeImpl)
    """

    name: str
    add_rms_norm: Callable
    rope_rows: Callable
    qk_norm_rope: Callable
    silu_mul: Callable
    moe: MoeImpl = torch_moe


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, w: Qwen3Weights):
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, w.eps, w.inv_hidden)


def _rope_rows(rope: torch.Tensor, positions: torch.Tensor):
    return rope.index_select(0, positions).split_with_sizes((1, 1), 1)  # cos, signed sin: [T, 1, hd] each


def rope_table_and_positions(rope: torch.Tensor, positions: torch.Tensor):
    """rope_rows of the fused kernels: they read each token's row of the table themselves."""
    return rope, positions


def _qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor | None, rows, w: Qwen3Weights) -> torch.Tensor:
    return apply_rope(qk if weight is None else rms_norm(qk, weight, w.eps, w.inv_head_dim), *rows)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


TORCH_OPS = LayerOps("torch", _add_rms_norm, _rope_rows, _qk_norm_rope, _silu_mul)


def _lora(y: torch.Tensor, x: torch.Tensor, lora: "LoraStep | None", layer: int, name: str) -> torch.Tensor:
    return y if lora is None else lora.add(y, x, layer, name)


def _qkv(cfg: ModelConfig, w: Qwen3Weights, lw: LayerWeights, x: torch.Tensor, rows, ops: LayerOps,
         lora: "LoraStep | None" = None, layer: int = 0):
    """q [T, heads, hd], k and v [T, kv_heads, hd]. q and k are normed and rotated together:
    one op sequence instead of two."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _lora(linear(x, lw.qkv, lw.qkv_bias), x, lora, layer, "qkv")
    qk, v = qkv.view(-1, nh + 2 * nkv, hd).split_with_sizes((nh + nkv, nkv), 1)
    q, k = ops.qk_norm_rope(qk, lw.qk_norm, rows, w).split_with_sizes((nh, nkv), 1)
    return q, k, v


def _mlp(lw: LayerWeights, x: torch.Tensor, ops: LayerOps, lora: "LoraStep | None" = None,
         layer: int = 0) -> torch.Tensor:
    if lw.moe is not None:
        return ops.moe(x, lw.moe)
    act = ops.silu_mul(_lora(linear(x, lw.gate_up), x, lora, layer, "gate_up"))
    return _lora(linear(act, lw.down), act, lora, layer, "down")


def final_logits(w: Qwen3Weights, h: torch.Tensor, out: torch.Tensor | None = None,
                 ops: LayerOps = TORCH_OPS, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 logits [T, vocab] of the last layer's hidden states `h`, written into `out` when given.
    `head`: what multiplies the normed states by the packed lm_head instead of `linear` (the cpu
    decode step's team: chip_child.cpu_kernels.decode_layers)."""
    x = ops.add_rms_norm(h, None, w.norm, w)[1]
    if out is not None and x.dtype == out.dtype and type(w.lm_head) is not PackedLinear:
        return torch.mm(x, w.lm_head, out=out)
    logits = (linear(x, w.lm_head) if head is None else head(x)).float()
    return logits if out is None else out.copy_(logits)


def forward(cfg: ModelConfig, w: Qwen3Weights, attn: AttentionBackend, step: StepPlan, rope: torch.Tensor,
            tokens: torch.Tensor, positions: torch.Tensor, all_reduce: AllReduce = _no_reduce,
            ops: LayerOps = TORCH_OPS, aux: tuple[tuple[int, ...], dict] | None = None,
            lora: "LoraStep | None" = None) -> torch.Tensor:
    """Every layer over the packed tokens [T] at `positions` [T]; `step` is the attention plan of
    this step's sequences (made once, shared by the layers). Leaves each token's K/V in the cache
    and returns the last layer's hidden states [T, hidden] (see final_logits). Each residual add
    is taken with the norm that follows it (one fused kernel under chip_child.models.fused). `aux`
    (layer ids, dict): the input of each of those layers is put in the dict under its id (what an
    EAGLE-3 head reads). `lora`: each token's adapter delta on every projection (chip_child.models.lora)."""
    rows = ops.rope_rows(rope, positions)
    h, delta = F.embedding(tokens, w.embed), None
    for i, lw in enumerate(w.layers):
        h, x = ops.add_rms_norm(h, delta, lw.input_norm, w)
        if aux is not None and i in aux[0]:
            aux[1][i] = h
        q, k, v = _qkv(cfg, w, lw, x, rows, ops, lora, i)
        o = attn.forward(i, q, k, v, step).flatten(1)
        h, x = ops.add_rms_norm(h, all_reduce(_lora(linear(o, lw.o_proj, lw.o_bias), o, lora, i, "o_proj")),
                                lw.post_norm, w)
        delta = all_reduce(_mlp(lw, x, ops, lora, i))
    return h + delta
