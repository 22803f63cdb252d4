#!/usr/bin/env python
"""The CPU decode attention kernel alone (chip_child/cpu_kernels/decode_attention.cpp, or
decode_attention_avx2.cpp on a cpu without AVX-512), cold: one
call per layer on each layer's own paged K/V cache (too large to stay in cache, as in a model),
bf16, at a few row counts. Each row's context is drawn from 128 to 256 tokens and its pages follow
one another in the cache, as a fresh pool gives them (--shuffle: pages in random order). Printed
per row count: ms for all layers and the K/V read rate.

    python scripts/bench_cpu_attention.py                          # the 128M peers shape, pages of 128
    python scripts/bench_cpu_attention.py --against HEAD~1 --rows 1,16   # against a past version

--against REV builds the kernel in use (decode_attention.cpp, or decode_attention_avx2.cpp on a
cpu without AVX-512) as it was at git revision REV beside the working tree's and times the two
alternately on the same caches, printing each one's median and the ratio; their outputs must be
the same bits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere
from chip_child.cpu_kernels import decode_attention  # noqa: E402
from chip_child.cpu_kernels.build import first_usable  # noqa: E402
from bench_common import past_cpu_kernel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16", help="comma-separated decode rows")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=3, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--max-context", type=int, default=256)
    p.add_argument("--shuffle", action="store_true", help="each row's pages in random order through the cache")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", default=None, metavar="REV", help="the kernel at this git revision, alternated")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lib = decode_attention.library()  # the AVX-512 kernel, or the AVX2 one on a cpu without AVX-512
    if lib is None:
        sys.exit("neither decode attention kernel runs here (their reasons are printed above)")
    kernels = {"l3worker": lib}
    with tempfile.TemporaryDirectory() as tmp:
        if a.against:
            used = first_usable(decode_attention.KERNEL, decode_attention.AVX2_KERNEL)  # the one `lib` is
            kernels[f"@{a.against}"] = past_cpu_kernel(used, a.against, tmp)
        for rows in (int(r) for r in a.rows.split(",")):
            run_rows(a, rows, kernels)


def run_rows(a: argparse.Namespace, rows: int, kernels: dict) -> None:
    g = torch.Generator().manual_seed(rows)
    per_row = -(-a.max_context // a.page_size)
    pages = rows * per_row
    order = torch.randperm(pages, generator=g) if a.shuffle else torch.arange(pages)
    table = order.to(torch.int32).view(rows, per_row)
    lens = torch.randint(a.max_context // 2, a.max_context + 1, (rows,), dtype=torch.int32, generator=g)
    caches = [tuple(torch.randn(a.kv_heads, pages, a.page_size, a.head_dim, generator=g).bfloat16() for _ in "kv")
              for _ in range(a.layers)]
    q = torch.randn(rows, a.kv_heads * a.group, a.head_dim, generator=g).bfloat16()
    scale = a.head_dim ** -0.5
    kv_bytes = 2 * a.layers * a.kv_heads * a.head_dim * 2 * int(lens.sum())  # K and V, bf16, every layer
    outs = {name: torch.empty_like(q) for name in kernels}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(a.repeats + 1):  # the first round warms each up
        for name, lib in kernels.items():
            t0 = time.perf_counter()
            for k, v in caches:
                decode_attention.attend(lib, q, k, v, table, lens, scale, outs[name])
            times[name].append(time.perf_counter() - t0)
    first = next(iter(kernels))
    if any(not torch.equal(outs[first], out) for out in outs.values()):
        print(f"rows {rows:>3}: the kernels' outputs differ")
    base = statistics.median(times[first][1:])
    for name, t in times.items():
        dt = statistics.median(t[1:])
        print(f"rows {rows:>3} {name:<10} {dt * 1e3:7.3f} ms  {kv_bytes / dt / 1e9:5.1f} GB/s  x{dt / base:.3f}")


if __name__ == "__main__":
    main()
