"""On-device sampling: greedy, temperature, top-k, top-p, with per-row seeds.

Random rows use the Gumbel-max trick with noise from a counter-based hash of
(row seed, position, token id). The noise a request sees depends on nothing but its own seed and
position, so a seeded request gives the same tokens whatever else shares the batch, and no
generator state has to live anywhere.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2**32).

    Both multipliers are below 2**31, so no product overflows int64 on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """Folds a user seed of any size into the 32-bit row key the device hashes with."""
    lo = torch.tensor([seed & _M32], dtype=torch.int64)
    hi = torch.tensor([(seed >> 32) & _M32], dtype=torch.int64)
    return int(hash32(lo ^ hash32(hi + 0x9E3779B9 & _M32))[0])


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ 0x5BD1E995)


def uniform_noise(keys: torch.Tensor, counters: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[N, V] floats in (0, 1), a pure function of (key, counter, token id)."""
    row = hash32(keys ^ (counters & _M32))
    bits = hash32(row[:, None] ^ vocab_keys[None, :]) >> 8  # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks with -inf everything outside each row's top-k, then outside its top-p nucleus
    (top_k 0 and top_p 1 disable a filter), as transformers' warpers do in that order."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    outside_k = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(outside_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token stays while the probability mass before it is below top_p; the first always stays.
    outside_p = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(outside_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    counters: torch.Tensor,
    vocab_keys: torch.Tensor,
    any_random: bool,
    any_filter: bool,
) -> torch.Tensor:
    """Next token ids [N] (int64). `any_random`/`any_filter` are host-side facts about the rows,
    kept by the runtime, so an all-greedy batch costs one argmax."""
    greedy = logits.argmax(dim=-1)
    if not any_random:
        return greedy
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    if any_filter:
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, counters, vocab_keys)))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
