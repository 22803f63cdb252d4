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
    lm_head: torch.Tensor

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
                    qkv=torch.cat([state[attn + f"{n}_proj.weight"][rows[n]] for n in "qkv"]),
                    qkv_bias=qkv_bias,
                    qk_norm=torch.cat([state[attn + "q_norm.weight"].expand(cfg.num_heads // world, hd),
                                       state[attn + "k_norm.weight"].expand(cfg.num_kv_heads // world, hd)]),
                    o_proj=state[attn + "o_proj.weight"][:, heads].contiguous(),
                    o_bias=o_bias,
                    post_norm=state[p + "post_attention_layernorm.weight"],
                    gate_up=torch.cat([state[p + "mlp.gate_proj.weight"][inter], state[p + "mlp.up_proj.weight"][inter]]),
                    down=state[p + "mlp.down_proj.weight"][:, inter].contiguous(),
                )
            )
        embed = state["model.embed_tokens.weight"]
        lm_head = embed if cfg.tie_word_embeddings else state["lm_head.weight"]
        return cls(embed=embed, layers=layers, norm=state["model.norm.weight"], lm_head=lm_head)

    def to(self, device: torch.device) -> "Qwen3Weights":
        return _move(self, device)


def _move(w: Qwen3Weights, device: torch.device) -> Qwen3Weights:
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    layers = [LayerWeights(**{k: to(v) for k, v in vars(lw).items()}) for lw in w.layers]
    return Qwen3Weights(embed=to(w.embed), layers=layers, norm=to(w.norm),
                        lm_head=w.embed.to(device) if w.lm_head is w.embed else to(w.lm_head))


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in fp32 and cast back before the weight, exactly as transformers' Qwen3RMSNorm."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for every position [max_len, head_dim], computed in fp32 then cast
    like transformers. The sin table carries rotate-half's minus sign on its first half, so
    apply_rope needs a roll instead of a negate-and-concatenate."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    return emb.cos().to(dtype=dtype, device=device), (emb.sin().to(dtype) * sign.to(dtype)).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos/signed_sin: [T, hd]."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1]; the sign lives in signed_sin
    return x * cos[:, None, :] + rotated * signed_sin[:, None, :]


@dataclass
class PagedKV:
    """The KV cache: [layers, 2, num_pages, page_size, kv_heads, head_dim]. Page 0 is scratch:
    inactive rows write there so a step never needs a host-side branch."""

    cache: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.cache.shape[3]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        flat = self.cache[layer].flatten(1, 2)  # [2, num_pages * page_size, kv_heads, hd]
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every row as [B, kv_heads, blocks * page_size, hd], read through the block table."""
        b, blocks = block_table.shape
        # index_select copies whole pages; advanced indexing is about twice as slow on the cpu.
        kv = self.cache[layer].index_select(1, block_table.flatten())  # [2, B * blocks, page, kv_heads, hd]
        kv = kv.view(2, b, blocks * self.page_size, *kv.shape[-2:]).transpose(2, 3)
        return kv[0], kv[1]


def _qkv(cfg: ModelConfig, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, heads, hd], k and v [T, kv_heads, hd]. q and k are normed and rotated together:
    one op sequence instead of two."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = F.linear(x, lw.qkv, lw.qkv_bias).unflatten(-1, (nh + 2 * nkv, hd))
    qk = apply_rope(rms_norm(qkv[:, :nh + nkv], lw.qk_norm, cfg.rms_norm_eps), cos, sin)
    return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]


def _mlp_residual(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
    gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
    return h + all_reduce(F.linear(F.silu(gate) * up, lw.down))


def prefill_forward(
    cfg: ModelConfig,
    w: Qwen3Weights,
    kv: PagedKV,
    rope: tuple[torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    prompt_lens: list[int],
    last_index: torch.Tensor,
    all_reduce: AllReduce = _no_reduce,
) -> torch.Tensor:
    """Several prompts packed into one token axis; causal within each prompt. Returns the last
    token's logits of each prompt [N, vocab] in fp32 and leaves every prompt's K/V in its pages."""
    cos, sin = rope[0][positions], rope[1][positions]
    h = F.embedding(tokens, w.embed)
    scale = cfg.head_dim**-0.5
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
        q, k, v = _qkv(cfg, lw, x, cos, sin)
        kv.write(i, k, v, slot_mapping)
        outs = []
        for qs, ks, vs in zip(q.split(prompt_lens), k.split(prompt_lens), v.split(prompt_lens)):
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True,
            )
            outs.append(o.transpose(0, 1))
        attn = torch.cat(outs).flatten(1)
        h = h + all_reduce(F.linear(attn, lw.o_proj, lw.o_bias))
        h = _mlp_residual(cfg, lw, h, all_reduce)
    h = rms_norm(h[last_index], w.norm, cfg.rms_norm_eps)
    return F.linear(h, w.lm_head).float()


def decode_forward(
    cfg: ModelConfig,
    w: Qwen3Weights,
    kv: PagedKV,
    rope: tuple[torch.Tensor, torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    all_reduce: AllReduce = _no_reduce,
) -> torch.Tensor:
    """One token per row. `block_table` is already narrowed to the blocks the longest row uses.
    Returns logits [B, vocab] in fp32."""
    cos, sin = rope[0][positions], rope[1][positions]
    h = F.embedding(input_ids, w.embed)
    b = input_ids.shape[0]
    ctx = block_table.shape[1] * kv.page_size
    # Key j of a row is visible when j <= the row's position: built on the device from positions.
    mask = (torch.arange(ctx, device=positions.device)[None, :] <= positions[:, None]).view(b, 1, 1, ctx)
    scale = cfg.head_dim**-0.5
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
        q, k, v = _qkv(cfg, lw, x, cos, sin)
        kv.write(i, k, v, slot_mapping)
        keys, values = kv.gather(i, block_table)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values,
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        h = h + all_reduce(F.linear(o.view(b, -1), lw.o_proj, lw.o_bias))
        h = _mlp_residual(cfg, lw, h, all_reduce)
    return F.linear(rms_norm(h, w.norm, cfg.rms_norm_eps), w.lm_head).float()
