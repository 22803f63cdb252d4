"""The seeded sampler's noise in torch ops, on any device: each token id's key, and the uniform
noise of (row key, counter, token id). chip_child.sampling.sampler draws with it (through the cpu
kernel of chip_child.cpu_kernels.sampling_noise where that runs, whose check compares against
torch_uniform_noise here)."""
from __future__ import annotations

import torch

from chip_child.sampling.seeds import M32, hash32


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ 0x5BD1E995)


def torch_uniform_noise(keys: torch.Tensor, counters: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[N, V] floats in (0, 1) in torch ops: the reference of sampler.uniform_noise."""
    row = hash32(keys ^ (counters & M32))
    bits = hash32(row[:, None] ^ vocab_keys[None, :]) >> 8  # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))
