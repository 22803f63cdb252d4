"""The counter-based hash the sampler's noise comes from, and a seed's row key.

Torch-free: `hash32` takes int64 tensors (the sampler's noise) and Python ints alike (the row key
of a seed, which the parent computes for a full state) and gives the same values for both.
"""
from __future__ import annotations

from typing import TypeVar

M32 = 0xFFFFFFFF
T = TypeVar("T")


def hash32(x: T) -> T:
    """A 32-bit integer mixer on values in [0, 2**32) (ints, or int64 tensors).

    Both multipliers are below 2**31, so no product overflows int64 on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def unhash32(y: int) -> int:
    """The x in [0, 2**32) with hash32(x) == y (each step of hash32 is a bijection): how checks
    reach a chosen hash, such as the noise's largest value."""
    def unshift(v: int, s: int) -> int:
        x = v
        for _ in range(32 // s + 1):
            x = v ^ (x >> s)
        return x

    x = unshift(y, 15)
    x = (x * pow(0x735A2D97, -1, 1 << 32)) & M32
    x = unshift(x, 15)
    x = (x * pow(0x21F0AAAD, -1, 1 << 32)) & M32
    return unshift(x, 16)


def seed_key(seed: int) -> int:
    """Folds a user seed of any size into the 32-bit row key the device hashes with."""
    lo, hi = seed & M32, (seed >> 32) & M32
    return hash32(lo ^ hash32(hi + 0x9E3779B9 & M32))
