#!/usr/bin/env python
"""Decode step time when few rows are busy: a step runs the lane bucket of its highest active row.

In-process (bench_decode's floor: ChipRuntime.execute in a loop, pinned like a worker's child) on
one of bench_decode's workloads, with `busy` of the `batch` rows decoding (rows 0..busy-1, where
the scheduler puts them) and the rest idle. For each busy count: the median over repeats of each
repeat's p50 decode step, and its ratio to all rows busy. Busy counts alternate within a repeat.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_decode import WORKLOADS, Floor, digest, make_prompts, write_checkpoint  # scripts/, next to this file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="overhead")
    ap.add_argument("--busy", default="2,16", help="comma-separated busy row counts (default 2,16)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run (default 64)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    wl = WORKLOADS[args.workload]
    busy = [int(b) for b in args.busy.split(",")]
    if not all(1 <= b <= wl.batch for b in busy):
        ap.error(f"--busy counts must be within 1..{wl.batch}")
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as tmp:
        write_checkpoint(Path(tmp), wl)
        floor = Floor(tmp, wl, args.threads)
        prompts = make_prompts(wl)
        p50s: dict[int, list[float]] = {b: [] for b in busy}
        digests: dict[int, set[str]] = {b: set() for b in busy}
        for _ in range(args.repeats):
            for b in busy:
                run = floor.run(prompts[:b], args.steps)
                p50s[b].append(float(np.median(run.step_s)))
                digests[b].add(digest(run.tokens))
    full = statistics.median(p50s[max(busy)])
    print(f"workload {wl.name}: batch {wl.batch}, prompts of {wl.prompt_len}, {args.steps} steps, "
          f"{args.repeats} repeats, {args.threads} thread(s)")
    print("| busy rows | step p50 (ms) | ratio to busy=" + str(max(busy)) + " | repeats' p50 (ms) |")
    print("| ---: | ---: | ---: | --- |")
    result = {}
    for b in busy:
        med = statistics.median(p50s[b])
        result[b] = dict(p50_ms=med * 1e3, ratio=med / full, repeats_ms=[x * 1e3 for x in p50s[b]])
        print(f"| {b} | {med * 1e3:.3f} | {med / full:.3f} | {', '.join(f'{x * 1e3:.2f}' for x in p50s[b])} |")
    same = all(len(d) == 1 for d in digests.values())
    print("tokens identical across repeats:", "yes" if same else "NO",
          "(sha256 " + ", ".join(f"busy={b}: {min(digests[b])}" for b in busy) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(workload=wl.name, steps=args.steps, busy=result), indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
