"""The seeded sampler's noise in torch ops, on any device: each token id's key, and the uniform
noise of (row key, counter, token id). chip_child.sampling.sampler draws with it (through the cpu
kernel of chip_child.cpu_kernels.sampling_noise where that runs, whose check compares against
torch_uniform_noise here)."""
from __future__ import annotations

import torch

from chip_child.sampling.seeds import M32, hash32

LARGEST_BITS = (1 << 24) - 2  # the noise's largest 24-bit value: it gives 1 - 2^-23


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ 0x5BD1E995)


def torch_uniform_noise(keys: torch.Tensor, counters: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[N, V] floats in (0, 1) in torch ops: the reference of sampler.uniform_noise."""
    return noise_at(keys, counters, vocab_keys[None, :])


def noise_at(keys: torch.Tensor, counters: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """The noise of each row [N] at the tokens whose vocab_hash keys are `token_keys` ([N, C], or
    [1, V] for every token): the values torch_uniform_noise gives at those tokens."""
    row = hash32(keys ^ (counters & M32))
    # 24 bits; the largest would round up to 1.0 (2^24 - 0.5 is not a float32), and -log(-log(1))
    # is +inf: that token would be drawn whatever its logit, a filtered one included.
    bits = (hash32(row[:, None] ^ token_keys) >> 8).clamp_(max=LARGEST_BITS)
    return (bits.float() + 0.5) * (1.0 / (1 << 24))
