"""The prefix cache's second tier, in host memory (`--kv-offloading-size`, vLLM's native
offloading): a page the device pool evicts keeps its cache entry here, and its K/V is copied to a
host slot instead of being lost; a later request whose chain reaches it gets it copied back into
a free device page instead of recomputing it.

The tier only keeps the books (entries by chain hash, least recently used first, free slots) and
the copies to make. The parent sends the copies before the command that needs them, as one
message (chip_child.protocol.Transfers), applied in the order they were made, so a store reads
the page as every earlier command and copy left it, and a load lands before any forward reads it. A slot freed by a
load is reused only after that message went out, so a store of the same message cannot overwrite
what the load still has to read.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

STORE, LOAD = 0, 1


class HostTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: dict[int, tuple[int, object]] = {}  # chain hash -> (slot, the pool's entry)
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashes, least recently stored first
        self._pending: list[tuple[int, int, int]] = []  # (STORE | LOAD, device page, slot), in order
        self._released: list[int] = []  # slots loaded from: free once the copies are taken
        self.stored_pages = 0
        self.loaded_pages = 0

    def __len__(self) -> int:
        return len(self._held)

    def store(self, key: int, entry: object, page: int) -> int | None:
        """Keeps an evicted device page's entry; returns the hash now gone from both tiers (None:
        none): the one it pushed out to make room, or `key` itself when every slot waits for a
        copy still to be sent."""
        dropped = None
        if not self._free:
            if not self._lru:
                return key
            dropped, _ = self._lru.popitem(last=False)
            self._free.append(self._held.pop(dropped)[0])
        slot = self._free.pop()
        self._held[key] = (slot, entry)
        self._lru[key] = None
        self._pending.append((STORE, page, slot))
        self.stored_pages += 1
        return dropped

    def find(self, key: int) -> object | None:
        held = self._held.get(key)
        return None if held is None else held[1]

    def take(self, key: int) -> tuple[int, object]:
        """(slot, entry) of `key`, out of the books (so no store pushes it out meanwhile) while a
        device page is found for it: `load` then, or `put_back`."""
        del self._lru[key]
        return self._held.pop(key)

    def put_back(self, key: int, slot: int, entry: object) -> None:
        self._held[key] = (slot, entry)
        self._lru[key] = None

    def load(self, slot: int, page: int) -> None:
        """Slot `slot`'s K/V to device page `page`; the slot is free once the copy went out."""
        self._pending.append((LOAD, page, slot))
        self._released.append(slot)
        self.loaded_pages += 1

    def take_copies(self) -> np.ndarray:
        """The copies to send now, in order, as (kind, page, slot) int32 rows; the slots loads
        read become free."""
        copies, self._pending = self._pending, []
        self._free.extend(self._released)
        self._released = []
        return np.array(copies, np.int32).reshape(-1, 3)

    def clear(self) -> list[int]:
        """Forgets everything held; returns the hashes."""
        keys = list(self._held)
        self._free.extend(slot for slot, _ in self._held.values())
        self._held.clear()
        self._lru.clear()
        return keys
