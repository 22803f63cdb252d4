"""Qwen3 as transformers defines it, as plain functions over a paged KV cache.

Weights are fused once at load (q/k/v into one matrix, gate/up into another) so a layer is four
matmuls. Attention never builds a dense mask on the host: decode reads K/V through the block table
and masks by each row's position on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from chip_child.loader import ModelConfig


@dataclass
class LayerWeights:
    """One layer's tensors. Projections are stored transposed ([in, out] views of the checkpoint's
    [out, in] tensors), so each is a single mm with no per-step transpose."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm per query head, then k_norm per kv head
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class Qwen3Weights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [hidden, vocab]; a view of embed when the embeddings are tied
    tied: bool
    # 0-dim constants of the norms: a python float would be wrapped into a tensor on every op.
    eps: torch.Tensor
    inv_hidden: torch.Tensor
    inv_head_dim: torch.Tensor

    @classmethod
    def from_hf(cls, state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int = 0,
                world: int = 1) -> "Qwen3Weights":
        """Fuses the HF tensors; with world > 1 keeps this rank's tensor-parallel shard: its
        slice of the heads and of the MLP's intermediate dimension (Megatron-style), with
        o_proj and down_proj split by input so one all-reduce after each completes the layer."""
        hd = cfg.head_dim
        heads = _shard(rank, world, cfg.num_heads * hd)
        kv_heads = _shard(rank, world, cfg.num_kv_heads * hd)
        inter = _shard(rank, world, cfg.intermediate_size)
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            rows = {"q": heads, "k": kv_heads, "v": kv_heads}
            qkv_bias = None
            o_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([state[attn + f"{n}_proj.bias"][rows[n]] for n in "qkv"])
                # Added by one rank only, so the all-reduce sums it in once.
                o_bias = state[attn + "o_proj.bias"] if rank == 0 else None
            layers.append(
                LayerWeights(
                    input_norm=state[p + "input_layernorm.weight"],
                    qkv=torch.cat([state[attn + f"{n}_proj.weight"][rows[n]] for n in "qkv"]).t(),
                    qkv_bias=qkv_bias,
                    qk_norm=torch.cat([state[attn + "q_norm.weight"].expand(cfg.num_heads // world, hd),
                                       state[attn + "k_norm.weight"].expand(cfg.num_kv_heads // world, hd)]),
                    o_proj=state[attn + "o_proj.weight"][:, heads].contiguous().t(),
                    o_bias=o_bias,
                    post_norm=state[p + "post_attention_layernorm.weight"],
                    gate_up=torch.cat([state[p + "mlp.gate_proj.weight"][inter],
                                       state[p + "mlp.up_proj.weight"][inter]]).t(),
                    down=state[p + "mlp.down_proj.weight"][:, inter].contiguous().t(),
                )
            )
        embed = state["model.embed_tokens.weight"]
        tied = cfg.tie_word_embeddings
        scalar = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        return cls(embed=embed, layers=layers, norm=state["model.norm.weight"],
                   lm_head=(embed if tied else state["lm_head.weight"]).t(), tied=tied,
                   eps=scalar(cfg.rms_norm_eps), inv_hidden=scalar(1 / cfg.hidden_size),
                   inv_head_dim=scalar(1 / hd))

    def to(self, device: torch.device) -> "Qwen3Weights":
        # Tensor.to keeps the transposed strides, so the moved projections are still [in, out] views.
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        layers = [LayerWeights(**{k: to(v) for k, v in vars(lw).items()}) for lw in self.layers]
        embed = to(self.embed)
        return Qwen3Weights(embed=embed, layers=layers, norm=to(self.norm),
                            lm_head=embed.t() if self.tied else to(self.lm_head), tied=self.tied,
                            eps=to(self.eps), inv_hidden=to(self.inv_hidden), inv_head_dim=to(self.inv_head_dim))


def _shard(rank: int, world: int, size: int) -> slice:
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank view of the model under tensor parallelism over `world` devices."""
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"device_ids: {world} devices do not divide the model's {name}={value}")
    return replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                   intermediate_size=cfg.intermediate_size // world)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, inv_dim: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: normalised in fp32, cast back, then scaled by the weight.
    Written out with 0-dim constants: F.rms_norm's cpu composite runs twice as many ops."""
    h = x if x.dtype == torch.float32 else x.float()
    h = h * torch.rsqrt(torch.addcmul(eps, (h * h).sum(-1, keepdim=True), inv_dim))
    return weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight_t [in, out] (+ bias): one mm."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def rope_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_len, 2, head_dim]: cos and sign-folded sin of every position, computed in fp32 then
    cast like transformers, side by side so one index_select fetches both. The sin row carries
    rotate-half's minus sign on its first half, so apply_rope needs a roll instead of a
    negate-and-concatenate."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    return torch.stack([emb.cos().to(dtype), emb.sin().to(dtype) * sign.to(dtype)], dim=1).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos, signed_sin: [T, 1, hd] (rows of the rope table)."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1]; the sign lives in signed_sin
    return x * cos + rotated * signed_sin


class PagedKV:
    """The KV cache, [layers, 2, kv_heads, num_pages, page_size, head_dim], and decode attention
    over it. Heads are outermost so a gather of pages gives each (kv head, row) its keys
    contiguous, ready for one batched matmul. Page 0 is scratch: inactive rows write there so a
    step never needs a host-side branch. `workspace` (at least [2, kv_heads, rows * blocks,
    page_size, head_dim] elements) receives every decode gather, so a step allocates no K/V copy."""

    def __init__(self, cache: torch.Tensor, workspace: torch.Tensor):
        self.cache = cache
        self.workspace = workspace.view(-1)
        # Per-layer views made once: a step should not pay for re-slicing the cache.
        self._layers = list(cache.unbind(0))  # [2, kvh, pages, page, hd]
        self._k_slots = [c[0].flatten(1, 2) for c in self._layers]  # [kvh, slots, hd]
        self._v_slots = [c[1].flatten(1, 2) for c in self._layers]
        self._key_index = torch.arange(cache.shape[3] * cache.shape[4], device=cache.device)
        self._visible_bias = torch.zeros((), dtype=cache.dtype, device=cache.device)
        self._hidden_bias = torch.full((), float("-inf"), dtype=cache.dtype, device=cache.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, kv_heads, hd] into the slots `slot_mapping` [T] names."""
        self._k_slots[layer].index_copy_(1, slot_mapping, k.transpose(0, 1))
        self._v_slots[layer].index_copy_(1, slot_mapping, v.transpose(0, 1))

    def decode_step(self, block_table: torch.Tensor, positions: torch.Tensor) -> "DecodeView":
        """What every layer of one decode step shares: the gather's index and target, and the mask."""
        b, blocks = block_table.shape
        _, _, kvh, _, page, hd = self.cache.shape
        ctx = blocks * page
        target = self.workspace[:2 * kvh * b * ctx * hd].view(2, kvh, b * blocks, page, hd)
        rows = target.view(2, kvh * b, ctx, hd)  # row b's keys for kv head j at j * B + b
        # Key j of a row is visible when j <= the row's position: 0 there, -inf elsewhere.
        row_positions = positions if kvh == 1 else positions.repeat(kvh)
        visible = self._key_index[:ctx][None, :] <= row_positions[:, None]
        bias = torch.where(visible, self._visible_bias, self._hidden_bias).unsqueeze(1)
        return DecodeView(block_table.flatten(), target, rows[0].transpose(1, 2), rows[1], bias)

    def gather(self, layer: int, view: "DecodeView") -> None:
        """Copies the pages of every row of `layer` into the view's keys and values."""
        torch.index_select(self._layers[layer], 2, view.pages, out=view.target)


@dataclass
class DecodeView:
    pages: torch.Tensor  # [B * blocks] page ids, row by row
    target: torch.Tensor  # the gather's output
    keys_t: torch.Tensor  # [kv_heads * B, hd, ctx], a view of target
    values: torch.Tensor  # [kv_heads * B, ctx, hd], a view of target
    bias: torch.Tensor  # [kv_heads * B, 1, ctx]


def decode_attention(q: torch.Tensor, view: DecodeView, scale: float) -> torch.Tensor:
    """One query token per row against its gathered keys. q: [B, heads, hd]. The query heads that
    share a kv head are the rows of one small matmul, so grouped-query attention needs no
    repeated keys. Returns [B, heads * hd]."""
    b, nh, hd = q.shape
    nkv = view.values.shape[0] // b
    group = nh // nkv
    q = q.view(b, nkv, group, hd).transpose(0, 1).reshape(nkv * b, group, hd)
    scores = torch.baddbmm(view.bias, q, view.keys_t, alpha=scale)
    if scores.dtype == torch.float32:
        probs = scores.softmax(-1)
    else:
        probs = scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
    out = torch.bmm(probs, view.values)  # [kvh * B, group, hd]
    return out.view(nkv, b, group, hd).transpose(0, 1).reshape(b, nh * hd)


def _qkv(cfg: ModelConfig, w: Qwen3Weights, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor):
    """q [T, heads, hd], k and v [T, kv_heads, hd]. q and k are normed and rotated together:
    one op sequence instead of two."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(x, lw.qkv, lw.qkv_bias).view(-1, nh + 2 * nkv, hd)
    qk = apply_rope(rms_norm(qkv[:, :nh + nkv], lw.qk_norm, w.eps, w.inv_head_dim), cos, sin)
    return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]


def _mlp_residual(w: Qwen3Weights, lw: LayerWeights, h: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    x = rms_norm(h, lw.post_norm, w.eps, w.inv_hidden)
    gate_up = linear(x, lw.gate_up)
    inter = gate_up.shape[-1] // 2
    return h + all_reduce(linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], lw.down))


def final_logits(w: Qwen3Weights, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [T, vocab] of the last layer's hidden states `h`, written into `out` when given."""
    x = rms_norm(h, w.norm, w.eps, w.inv_hidden)
    if out is not None and x.dtype == out.dtype:
        return torch.mm(x, w.lm_head, out=out)
    logits = linear(x, w.lm_head).float()
    return logits if out is None else out.copy_(logits)


def prefill_forward(
    cfg: ModelConfig,
    w: Qwen3Weights,
    kv: PagedKV,
    rope: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    prompt_lens: list[int],
    last_index: torch.Tensor,
    all_reduce: AllReduce = _no_reduce,
    return_hidden: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Several prompts packed into one token axis; causal within each prompt. Returns the last
    token's logits of each prompt [N, vocab] in fp32 and leaves every prompt's K/V in its pages.
    With `return_hidden`, also every token's last hidden state [T, hidden], from which
    `final_logits` gives any token's logits (prompt log-probabilities, a chunk at a time)."""
    cos_sin = rope.index_select(0, positions)
    cos, sin = cos_sin[:, :1], cos_sin[:, 1:]
    h = F.embedding(tokens, w.embed)
    scale = cfg.head_dim**-0.5
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.input_norm, w.eps, w.inv_hidden)
        q, k, v = _qkv(cfg, w, lw, x, cos, sin)
        kv.write(i, k, v, slot_mapping)
        outs = []
        for qs, ks, vs in zip(q.split(prompt_lens), k.split(prompt_lens), v.split(prompt_lens)):
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True,
            )
            outs.append(o.transpose(0, 1))
        attn = torch.cat(outs).flatten(1)
        h = h + all_reduce(linear(attn, lw.o_proj, lw.o_bias))
        h = _mlp_residual(w, lw, h, all_reduce)
    logits = final_logits(w, h[last_index])
    return (logits, h) if return_hidden else logits


def decode_forward(
    cfg: ModelConfig,
    w: Qwen3Weights,
    kv: PagedKV,
    rope: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    logits: torch.Tensor,
    all_reduce: AllReduce = _no_reduce,
) -> torch.Tensor:
    """One token per row. `block_table` is already narrowed to the blocks the longest row uses.
    Writes fp32 logits [B, vocab] into `logits` and returns it."""
    cos_sin = rope.index_select(0, positions)
    cos, sin = cos_sin[:, :1], cos_sin[:, 1:]
    h = F.embedding(input_ids, w.embed)
    view = kv.decode_step(block_table, positions)
    scale = cfg.head_dim**-0.5
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.input_norm, w.eps, w.inv_hidden)
        q, k, v = _qkv(cfg, w, lw, x, cos, sin)
        kv.write(i, k, v, slot_mapping)
        kv.gather(i, view)
        o = decode_attention(q, view, scale)
        h = h + all_reduce(linear(o, lw.o_proj, lw.o_bias))
        h = _mlp_residual(w, lw, h, all_reduce)
    return final_logits(w, h, out=logits)
