"""KV-cache pages from a share of the device's memory (vLLM's `gpu_memory_utilization`), or from a
number of bytes for the cache alone (vLLM's `kv_cache_memory_bytes`, and on a cpu its
VLLM_CPU_KVCACHE_SPACE in GiB).

vLLM gives the KV cache what is left of `gpu_memory_utilization` x the device's memory once the
weights (and its profiled activations) are in. The parent computes the same before any child
starts, from the model's KV bytes per token and its weight bytes; activations are not measured
here, which is why the fraction should leave them room. On a cpu the "device" is the memory the
process may use (the machine's RAM, or its cgroup's limit when lower), shared by every child on the
node; an accelerator's is that device's own memory, read in a short subprocess so that the parent
never opens a device.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from chip_child.models.loader import ModelConfig, expected_tensor_shapes

GIB = 1 << 30
MAX_SLOTS = 2**31 - 1  # KV slot ids (page * page_size + offset) are int32 on the wire
_PROBE_TIMEOUT_S = 120.0
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's, on its cpu backend: the KV cache's GiB
# The device's total memory and what is free now, in bytes, from a child that exits at once.
_PROBE = """import sys, torch
kind, index = sys.argv[1], int(sys.argv[2])
if kind == "npu":
    import torch_npu  # noqa: F401
mod = getattr(torch, kind)
free, total = mod.mem_get_info(index)
print(total, free)
"""


@dataclass(frozen=True)
class KvSizing:
    """How many KV pages a memory fraction buys: every figure per device (a cpu node is one device)."""

    fraction: float | None  # gpu_memory_utilization; None where the cache's bytes were given
    memory_bytes: int  # what the fraction is of, or the cache's bytes
    weight_bytes: int  # the weights held in that memory
    page_bytes: int  # one page of every layer's K and V, over the ranks sharing the memory
    num_pages: int  # usable pages (the scratch page 0 not counted)
    page_size: int
    device: str  # "cpu" or "cuda:N" / "npu:N": where memory_bytes was read
    source: str  # the setting the pages came from, with its value

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> str:
        if self.fraction is None:
            return f"{self.num_pages} KV pages ({self.tokens} tokens) in {_size(self.memory_bytes)} ({self.source})"
        return (f"{self.num_pages} KV pages ({self.tokens} tokens) in {self.fraction} of {_size(self.memory_bytes)} "
                f"({self.device}) less {_size(self.weight_bytes)} of weights")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """K and V over every layer for one token position (`cfg`: one rank's view, its share of the heads)."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The weights of `cfg` (one rank's view under tensor parallelism) in the runtime dtype;
    quantized projections take one byte an element (their scales are small enough to ignore)."""
    total = 0
    for name, shape in expected_tensor_shapes(cfg).items():
        quantized = cfg.quantization is not None and name.endswith("_proj.weight") and len(shape) == 2
        total += math.prod(shape) * (1 if quantized else itemsize)
    return total


def cpu_memory_bytes() -> int:
    """The memory this process may use: physical RAM, or the cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return min(total, limit) if limit is not None else total


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit (v2's memory.max or v1's memory.limit_in_bytes); None
    when there is none or it cannot be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2, unified
            candidates += [Path(root) / rel / "memory.max", Path(root) / "memory.max"]
        elif "memory" in controllers.split(","):  # v1
            candidates += [Path(root) / "memory" / rel / "memory.limit_in_bytes",
                           Path(root) / "memory" / "memory.limit_in_bytes"]
    limits = []
    for candidate in candidates:
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes a huge number for "no limit", v2 "max"
            limits.append(int(text))
    return min(limits) if limits else None


def accelerator_memory_bytes(kind: str, device_id: int) -> tuple[int, int]:
    """(total, free) bytes of `kind` device `device_id`, read by a subprocess (the parent opens no device)."""
    why = "no answer"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, kind, str(device_id)], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S)
        if done.returncode == 0:
            total, free = (int(x) for x in done.stdout.split())
            return total, free
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    except (subprocess.SubprocessError, ValueError, OSError) as e:
        why = str(e)
    raise ValueError(f"gpu_memory_utilization: cannot read the memory of {kind} device {device_id}: {why}")


def size_kv_cache(cfg: ModelConfig, *, fraction: float, kind: str, device_id: int, itemsize: int,
                  local_ranks: int, page_size: int, max_seq_len: int,
                  memory: tuple[int, int] | None = None, kv_itemsize: int | None = None) -> KvSizing:
    """The pages `fraction` of the memory holds once the weights are in (`itemsize` bytes each;
    the cache's `kv_itemsize`, default the same: 1 for an fp8 cache). `cfg` is one rank's view
    (shard_config); `local_ranks` of them share a cpu node's memory. `memory`: (total, free)
    instead of reading it (tests). ValueError naming gpu_memory_utilization when out of (0, 1], when
    an accelerator has less free than the fraction asks, or when one row of max_seq_len does not fit."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"gpu_memory_utilization must be a float in (0, 1], got {fraction!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    on_cpu = kind == "cpu"
    if memory is None:
        memory = (cpu_memory_bytes(),) * 2 if on_cpu else accelerator_memory_bytes(kind, device_id)
    total, free = memory
    requested = int(fraction * total)
    where = "cpu" if on_cpu else f"{kind}:{device_id}"
    if not on_cpu and free < requested:  # vLLM's start-up check: another process holds the memory
        raise ValueError(f"gpu_memory_utilization={fraction}: {where} has {_size(free)} free of {_size(total)}, "
                         f"less than the {_size(requested)} asked for; lower it")
    sharing = local_ranks if on_cpu else 1  # a cpu node's ranks share one memory
    weights = weight_bytes(cfg, itemsize) * sharing
    page_bytes = kv_bytes_per_token(cfg, kv_itemsize or itemsize) * page_size * sharing
    # One page more than the usable ones: page 0 is the scratch page idle rows write to.
    num_pages = min(max(requested - weights, 0) // page_bytes - 1, MAX_SLOTS // page_size - 1)
    sizing = KvSizing(fraction, total, weights, page_bytes, max(num_pages, 0), page_size, where,
                      f"gpu_memory_utilization {fraction}")
    return _room_for_a_row(sizing, f"gpu_memory_utilization={fraction}", "gpu_memory_utilization", max_seq_len)


def kv_cache_bytes(asked: int | None, kind: str, environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    """The KV cache's bytes on each device and the setting they came from: `asked` (vLLM's
    kv_cache_memory_bytes), else on a cpu vLLM's VLLM_CPU_KVCACHE_SPACE (GiB; unset, empty or 0: not
    given); None for neither. ValueError naming the setting for a value that is not a positive integer."""
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int) or asked <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be a positive number of bytes, got {asked!r}")
        return asked, f"kv_cache_memory_bytes={asked}"
    text = (os.environ if environ is None else environ).get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if kind != "cpu" or text in ("", "0"):
        return None
    if not text.isdigit():
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV} must be a whole number of GiB, got {text!r}")
    return int(text) * GIB, f"{CPU_KVCACHE_SPACE_ENV}={text}"


def size_kv_cache_in(cfg: ModelConfig, kv_bytes: tuple[int, str], *, kind: str, local_ranks: int,
                     kv_itemsize: int, page_size: int, max_seq_len: int, memory: int | None = None) -> KvSizing:
    """The pages a cache of `kv_bytes` (kv_cache_bytes) holds on each device; the weights come on top.
    `cfg` is one rank's view: each rank holds its share of the heads in bytes of its own, as vLLM's
    workers do. ValueError naming the setting when one row of max_seq_len does not fit, or on a cpu
    when the `local_ranks` caches exceed the memory this process may use (`memory`: instead of reading it)."""
    total, source = kv_bytes
    field = source.partition("=")[0]
    if kind == "cpu":
        memory = cpu_memory_bytes() if memory is None else memory
        if total * local_ranks > memory:
            raise ValueError(f"{source}: {local_ranks} cache(s) of {_size(total)} exceed the {_size(memory)} of "
                             f"memory this process may use; lower {field}")
    page_bytes = kv_bytes_per_token(cfg, kv_itemsize) * page_size
    num_pages = min(total // page_bytes - 1, MAX_SLOTS // page_size - 1)  # page 0: the scratch page
    sizing = KvSizing(None, total, 0, page_bytes, max(num_pages, 0), page_size, "each device", source)
    return _room_for_a_row(sizing, source, field, max_seq_len)


def _room_for_a_row(sizing: KvSizing, asked: str, field: str, max_seq_len: int) -> KvSizing:
    row_pages = math.ceil(max_seq_len / sizing.page_size)
    if sizing.num_pages < row_pages:
        raise ValueError(f"{asked} leaves {sizing.describe()}; one row of max_seq_len={max_seq_len} needs "
                         f"{row_pages} pages of {sizing.page_size} tokens: raise {field} or lower max_seq_len")
    return sizing


def host_tier_pages(cfg: ModelConfig, size_gib: float | None, itemsize: int, page_size: int) -> int:
    """Pages of the prefix cache's host tier in `size_gib` GiB (vLLM's --kv-offloading-size); 0
    for None. ValueError naming kv_offloading_size when it holds less than one page."""
    if size_gib is None:
        return 0
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)):
        raise TypeError(f"kv_offloading_size must be a number of GiB, got {size_gib!r}")
    page_bytes = kv_bytes_per_token(cfg, itemsize) * page_size
    pages = int(size_gib * 2**30 // page_bytes)
    if pages < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no page of {page_bytes} bytes")
    return pages
