"""The parent's KV page allocator. Page 0 is the device's scratch page and is never handed out."""
from __future__ import annotations


class PageAllocator:
    """Admission reserves every page a request can need, so decode never runs out; page ids are
    then taken from the reservation one at a time, as rows cross page boundaries."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self._free = list(range(num_pages, 0, -1))
        self._reserved = 0

    @property
    def num_free(self) -> int:
        """Pages neither in use nor promised to an admitted request."""
        return len(self._free) - self._reserved

    def reserve(self, count: int) -> bool:
        if count > self.num_free:
            return False
        self._reserved += count
        return True

    def take(self) -> int:
        """A page from an earlier reservation."""
        assert self._reserved > 0, "take() without a reservation"
        self._reserved -= 1
        return self._free.pop()

    def release(self, pages: list[int], unused_reservation: int) -> None:
        self._free.extend(pages)
        self._reserved -= unused_reservation
