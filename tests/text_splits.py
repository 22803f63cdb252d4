"""What the streaming-parser tests share: ways to cut a text into deltas."""

from __future__ import annotations

import random


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every two-piece split, one char per delta, and a few random multi-piece splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out
