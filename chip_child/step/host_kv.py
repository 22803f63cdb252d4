"""The host tier of the KV cache: as many pages as the parent's host tier has slots, in host memory
(pinned off the cpu), in the cache's own layout and dtype, and the page copies between the two
(chip_child.protocol.Copies), applied in the order the parent made them."""
from __future__ import annotations

import numpy as np
import torch

STORE = 0  # device page -> host slot; 1: host slot -> device page


class HostKV:
    def __init__(self, cache: torch.Tensor, cache_layout: str, slots: int):
        self.cache = cache
        self.dim = [d.strip() for d in cache_layout.split(",")].index("page")
        shape = list(cache.shape)
        shape[self.dim] = slots
        pin = cache.device.type != "cpu"
        self.pages = torch.zeros(shape, dtype=cache.dtype, pin_memory=pin)

    @torch.inference_mode()
    def apply(self, copies: np.ndarray) -> None:
        for kind, page, slot in copies.tolist():
            if kind == STORE:
                self.pages.select(self.dim, slot).copy_(self.cache.select(self.dim, page))
            else:
                self.cache.select(self.dim, page).copy_(self.pages.select(self.dim, slot))
