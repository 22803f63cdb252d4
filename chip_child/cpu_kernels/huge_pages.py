"""CPU tensors on transparent huge pages, for the packed weights every decode step streams.

A decode step of a few rows reads every weight once and is bound by memory bandwidth. On 4 KiB
pages each page of that stream costs a TLB miss and a page walk (two levels of walk in a virtual
machine); on 2 MiB pages the whole 128M model takes about 130 of them. Measured on the 2-core CI
machine (`python scripts/bench_cpu_huge_pages.py`, the same packed weights on either kind of page
under one runtime, alternated): a 128M Qwen3's batch-1 decode step took 0.88 to 0.97x the time on
huge pages; at 16 rows, bound by compute, the difference was within the noise.

Linux gives huge pages to a private anonymous mapping that asks for them (`madvise`) before it is
first written, where `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`. So
each tensor gets a mapping of its own, 2 MiB aligned, that lives as long as the tensor does (a
weight update that replaces a matrix frees the old one's pages). The tail that fills less than
half a huge page stays on small pages, so padding never costs more than half a huge page per
matrix. Where huge pages are off (`never`) or the kernel refuses, the tensor is on small pages and
`HugePageStats` counts it; `stats()["cpu_huge_pages"]` shows both counts and the system setting.
"""
from __future__ import annotations

import mmap
from dataclasses import asdict, dataclass

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass
class HugePageStats:
    """What this process has asked for so far: bytes madvised onto huge pages, and tensors left
    on small pages with why (the system setting, or the kernel's refusal)."""

    setting: str  # "always", "madvise", "never", or "unavailable" (no such file: not Linux)
    madvised_bytes: int = 0
    small_page_tensors: int = 0
    refused: str | None = None  # the last OSError from madvise

    @property
    def system_allows(self) -> bool:
        """Whether the system gives huge pages to a mapping that asks (THP `always` or `madvise`)."""
        return self.setting in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")

    def to_dict(self) -> dict:
        return asdict(self)


def thp_setting(path: str = THP_SETTING) -> str:
    """The bracketed word of the system's transparent huge page setting."""
    try:
        text = open(path).read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


STATS = HugePageStats(setting=thp_setting())


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat CPU tensor of `numel` elements whose bytes lie on huge pages where the
    system gives them (the tail under half a huge page excepted); a plain torch.empty otherwise."""
    nbytes = numel * dtype.itemsize
    huge_bytes = (nbytes + HUGE_PAGE // 2) // HUGE_PAGE * HUGE_PAGE
    if huge_bytes == 0 or not STATS.system_allows:
        STATS.small_page_tensors += 1
        return torch.empty(numel, dtype=dtype)
    # One huge page more than needed, so a 2 MiB aligned start lies inside the mapping.
    region = mmap.mmap(-1, max(nbytes, huge_bytes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for the tensor's lifetime
    offset = -view.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, huge_bytes)
        STATS.madvised_bytes += huge_bytes
    except OSError as e:
        STATS.small_page_tensors += 1
        STATS.refused = str(e)
    return view[offset:offset + nbytes].view(dtype)
