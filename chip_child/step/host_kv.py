"""The host tier of the KV cache: as many pages as the parent's host tier has slots, in host memory
(pinned off the cpu), in the cache's own layout and dtype, and the page copies between the two
(chip_child.protocol.Copies), applied in the order the parent made them."""
from __future__ import annotations

import numpy as np
import torch

STORE = 0  # device page -> host slot; 1: host slot -> device page


def copy_runs(copies: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The copies as runs of one kind, in order, each writing no target twice: (kind, pages,
    slots). A run is one gather and one scatter, and the runs applied in order give the result
    of applying the copies one by one."""
    runs: list[tuple[int, list[int], list[int]]] = []
    targets: set[int] = set()
    for kind, page, slot in copies.tolist():
        target = slot if kind == STORE else page
        if not runs or runs[-1][0] != kind or target in targets:
            runs.append((kind, [], []))
            targets = set()
        runs[-1][1].append(page)
        runs[-1][2].append(slot)
        targets.add(target)
    return [(kind, np.asarray(pages), np.asarray(slots)) for kind, pages, slots in runs]


class HostKV:
    def __init__(self, cache: torch.Tensor, cache_layout: str, slots: int, batched: bool | None = None):
        """`batched` (default: off the cpu) moves each run of copies with one gather and one
        scatter; otherwise page by page, which the cpu does faster (31 pages of the
        bench_kv_offload model: 0.4 ms page by page, 1.3-1.7 ms batched)."""
        self.batched = cache.device.type != "cpu" if batched is None else batched
        self.dim = [d.strip() for d in cache_layout.split(",")].index("page")
        shape = list(cache.shape)
        shape[self.dim] = slots
        pin = cache.device.type != "cpu"
        pages = torch.zeros(shape, dtype=cache.dtype, pin_memory=pin)
        # index_copy_ has no float8 kernel: one-byte caches move as their bytes
        one_byte = cache.element_size() == 1 and cache.dtype != torch.uint8
        self.cache = cache.view(torch.uint8) if one_byte else cache
        self.pages = pages.view(torch.uint8) if one_byte else pages

    @torch.inference_mode()
    def apply(self, copies: np.ndarray) -> None:
        if not self.batched:
            for kind, page, slot in copies.tolist():
                if kind == STORE:
                    self.pages.select(self.dim, slot).copy_(self.cache.select(self.dim, page))
                else:
                    self.cache.select(self.dim, page).copy_(self.pages.select(self.dim, slot))
            return
        device = self.cache.device
        for kind, pages, slots in copy_runs(copies):
            page_ids = torch.from_numpy(pages).to(device)
            slot_ids = torch.from_numpy(slots)
            if kind == STORE:
                self.pages.index_copy_(self.dim, slot_ids, self.cache.index_select(self.dim, page_ids).cpu())
            else:
                # the copy and the step's kernels share one stream: every load lands before the
                # attention that reads it
                loaded = self.pages.index_select(self.dim, slot_ids).to(device, non_blocking=True)
                self.cache.index_copy_(self.dim, page_ids, loaded)
