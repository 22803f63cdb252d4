#!/usr/bin/env python
"""CPU step times with the linear layers plain (torch.mm) and prepacked for oneDNN (cpu_prepack).

On bench_cpu's models, in this process: for each cpu layout's thread count (every_core: every
core; spare_core: one core less, as a chip-child gets it) and each row count, two runtimes that
differ only in `cpu_prepack` time a prefill step (every row's prompt of --prompt-len tokens, one
packed step of rows x prompt-len tokens) and the median greedy decode step with every row
active (ChipRuntime.time_steps). The two alternate within each repeat; printed: the medians over
--repeats in ms and prepacked / plain. Timings are noisy on a shared machine: compare the ratios.

    python scripts/bench_prepack.py                  # small and wide, rows 1, 5, 16, both layouts
    python scripts/bench_prepack.py --workload deep --rows 1,16 --repeats 9
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere

import torch  # noqa: E402
from bench_cpu import BASE_MODEL, WORKLOADS  # noqa: E402  (scripts/, next to this file)
from bench_models import write_random_qwen3  # noqa: E402

from chip_child.device import default_cpu_threads  # noqa: E402
from chip_child.step.runtime import ChipRuntime, RuntimeConfig  # noqa: E402

VARIANTS = {"plain": False, "prepacked": True}


def layouts() -> dict[str, int]:
    """Each cpu layout's intra-op threads for one chip-child (the same count is not run twice)."""
    threads: dict[str, int] = {}
    for layout in ("every_core", "spare_core"):
        n = default_cpu_threads(1, layout)
        if n not in threads.values():
            threads[layout] = n
    return threads


def bench(model_dir: str, rows: int, threads: int, args) -> dict[str, tuple[float, float]]:
    """{variant: (median prefill step s, median decode step s)}, the variants alternated."""
    runtimes = {name: ChipRuntime(RuntimeConfig(model_dir, device="cpu", dtype="float32", max_batch_size=rows,
                                                max_seq_len=args.prompt_len + args.steps + 8, page_size=16,
                                                max_prefill_tokens=rows * args.prompt_len, num_threads=threads,
                                                cpu_prepack=on))
                for name, on in VARIANTS.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    try:
        for _ in range(args.repeats):
            for name, rt in runtimes.items():
                torch.set_num_threads(threads)
                times[name].append(rt.time_steps(rows * args.prompt_len, args.steps, args.budget_s))
    finally:
        for rt in runtimes.values():
            rt.close()
    return {name: (statistics.median(p for p, _ in t), statistics.median(d for _, d in t))
            for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="default: small and wide")
    ap.add_argument("--rows", default="1,5,16", help="decode rows (comma-separated)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per repeat (median kept)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="at most this long on decode steps per repeat")
    ap.add_argument("--prompt-len", type=int, default=100, help="tokens per row of the timed prefill step")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, oneDNN {torch.backends.mkldnn.is_available()}, fp32; "
          f"median of {args.repeats}; ratio = prepacked / plain")
    print(f"{'workload':<8} {'layout':<10} {'thr':>3} {'rows':>4} | {'decode plain':>12} {'prepacked':>9} "
          f"{'ratio':>5} | {'prefill tok':>11} {'plain':>8} {'prepacked':>9} {'ratio':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workload or ["small", "wide"]:
            wl = WORKLOADS[name]
            model_dir = str(Path(tmp) / name)
            write_random_qwen3(Path(model_dir), {**BASE_MODEL, **wl.model}, wl.seed)
            for layout, threads in layouts().items():
                for r in rows:
                    t = bench(model_dir, r, threads, args)
                    (pp, pd), (kp, kd) = t["plain"], t["prepacked"]
                    print(f"{name:<8} {layout:<10} {threads:>3} {r:>4} | {pd * 1e3:>9.3f} ms {kd * 1e3:>6.3f} ms "
                          f"{kd / pd:>5.2f} | {r * args.prompt_len:>11} {pp * 1e3:>5.1f} ms {kp * 1e3:>6.1f} ms "
                          f"{kp / pp:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
