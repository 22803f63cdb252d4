"""Costs of the KV page pool's hot paths, and of the ways to hash a full page's token ids.

    python scripts/bench_page_pool.py [--page-size 128] [--repeat 7]

Prints the best of --repeat timings per call (the least disturbed on a shared machine).
"""
from __future__ import annotations

import argparse
import hashlib
import random
import struct
import timeit

import numpy as np

from l3worker.engine.page_pool import PagePool


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    ps, rep = args.page_size, args.repeat
    rng = random.Random(0)
    ids_list = [rng.randrange(151_000) for _ in range(ps * 128)]  # a 16k-token prompt at 128
    ids_np = np.array(ids_list, np.int32)
    parent = hash(("parent",))
    parent_b = parent.to_bytes(8, "little", signed=True)
    pack = struct.Struct(f"={ps}i").pack
    a, b = 17 * ps, 18 * ps

    print(f"one {ps}-token page: ids -> key (microseconds per page)")
    cases = {
        "list  -> tuple, hash((parent, tuple))": lambda: hash((parent, tuple(ids_list[a:b]))),
        "array -> tuple, hash((parent, tuple))": lambda: hash((parent, tuple(ids_np[a:b].tolist()))),
        "list  -> int32 bytes (struct), hash((parent, bytes))": lambda: hash((parent, pack(*ids_list[a:b]))),
        "array -> int32 bytes, hash((parent, bytes))   [chosen]": lambda: hash((parent, ids_np[a:b].tobytes())),
        "list  -> int32 bytes (struct), sha256(parent + bytes)": lambda: hashlib.sha256(
            parent_b + pack(*ids_list[a:b])).digest(),
        "array -> int32 bytes, sha256(parent + bytes)": lambda: hashlib.sha256(parent_b + ids_np[a:b].tobytes()).digest(),
        "array -> int32 bytes, blake2b-64(parent + bytes)": lambda: hashlib.blake2b(
            parent_b + ids_np[a:b].tobytes(), digest_size=8).digest(),
    }
    for name, fn in cases.items():
        print(f"  {name:58s} {best_us(fn, 20_000, rep):7.3f}")
    page_b, page_t = ids_np[a:b].tobytes(), tuple(ids_list[a:b])
    copy_b, copy_t = bytes(bytearray(page_b)), tuple(list(page_t))  # equal, distinct objects
    print("  stored ids compared on a hit:")
    print(f"    {'bytes == bytes (' + str(len(page_b)) + ' B)':56s} {best_us(lambda: page_b == copy_b, 100_000, rep):7.3f}")
    print(f"    {'tuple == tuple':56s} {best_us(lambda: page_t == copy_t, 100_000, rep):7.3f}")
    print("pool operations (microseconds per call)")
    pool = PagePool(4096, ps)
    pages = pool.allocate(128)
    pool.commit(pool.lookup(ids_np).cursor, pages, ids_np, len(ids_np))
    prompt = np.concatenate([ids_np, np.array([1], np.int32)])

    def lookup_hit():
        pool.cancel_lookup(pool.lookup(prompt))

    prompt_list = prompt.tolist()

    def lookup_hit_list():
        pool.cancel_lookup(pool.lookup(prompt_list))

    miss = prompt.copy()
    miss[0] += 1

    def lookup_miss():
        pool.cancel_lookup(pool.lookup(miss))

    def alloc_free_1():
        pool.free(pool.allocate(1))

    def alloc_free_64():
        pool.free(pool.allocate(64))

    def commit_page():
        new = pool.allocate(2)
        hit = pool.lookup(prompt[:ps])  # a miss: the cursor at the root
        pool.commit(hit.cursor, new, miss, 2 * ps)
        pool.free(new)
        pool.reset_prefix_cache()

    print(f"  {'lookup, 128 cached pages hit (16k tokens at 128), + cancel':58s} {best_us(lookup_hit, 500, rep):7.1f}")
    print(f"  {'the same, ids as a list of ints':58s} {best_us(lookup_hit_list, 200, rep):7.1f}")
    print(f"  {'lookup, miss on the first page, + cancel':58s} {best_us(lookup_miss, 20_000, rep):7.2f}")
    print(f"  {'allocate(1) + free':58s} {best_us(alloc_free_1, 20_000, rep):7.2f}")
    print(f"  {'allocate(64) + free':58s} {best_us(alloc_free_64, 2_000, rep):7.2f}")
    print(f"  {'commit 2 pages (+ allocate, free, reset)':58s} {best_us(commit_page, 5_000, rep):7.2f}")
    cursor = pool.lookup(prompt).cursor
    print(f"  {'commit with nothing new full (the per-step call)':58s} "
          f"{best_us(lambda: pool.commit(cursor, pages, prompt, len(prompt)), 50_000, rep):7.3f}")
    pool.check()


if __name__ == "__main__":
    main()
