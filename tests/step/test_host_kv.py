"""The child's host tier (chip_child.step.host_kv): page copies applied in runs (one gather and
one scatter each, as on a GPU) leave the cache and the host pages exactly as copies applied one by
one, whatever the layout and dtype, with repeated targets and kinds interleaved."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chip_child.step.host_kv import STORE, HostKV, copy_runs

LAYOUTS = {"torch": ("layer, k|v, kv_head, page, offset, head_dim", (3, 2, 2, 12, 4, 8)),
           "triton": ("layer, k|v, page, offset, kv_head, head_dim", (3, 2, 12, 4, 2, 8))}


def test_runs_split_where_the_kind_changes_or_a_target_repeats() -> None:
    copies = np.array([[STORE, 1, 0], [STORE, 2, 1], [STORE, 3, 0], [1, 5, 1], [1, 6, 0], [1, 5, 2]])
    runs = [(kind, pages.tolist(), slots.tolist()) for kind, pages, slots in copy_runs(copies)]
    assert runs == [(STORE, [1, 2], [0, 1]), (STORE, [3], [0]), (1, [5, 6], [1, 0]), (1, [5], [2])]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_batched_copies_equal_copies_one_by_one(layout: str, dtype: torch.dtype) -> None:
    names, shape = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(shape, generator=gen).to(dtype)
    rng = np.random.default_rng(1)
    copies = np.stack([rng.integers(0, 2, 40), rng.integers(0, 12, 40), rng.integers(0, 6, 40)], axis=1)
    done = {}
    for batched in (False, True):
        kv = HostKV(cache.clone(), names, 6, batched=batched)
        kv.apply(copies)
        done[batched] = (kv.cache.view(torch.uint8), kv.pages.view(torch.uint8))
    assert torch.equal(done[True][0], done[False][0]) and torch.equal(done[True][1], done[False][1])
    assert done[False][1].any()  # pages were stored
