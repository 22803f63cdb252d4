#!/usr/bin/env python
"""What each of l3worker's CPU kernels is worth end to end (chip_child/cpu_kernels): `l3worker
bench throughput` and `bench latency` on one checkpoint with every kernel on, each one turned off
(L3WORKER_REFERENCE_KERNELS), and all off, alternated within each repeat. Printed per variant:
the median output tok/s and batch-1 latency over --repeats, and their ratio to "all on".

    python scripts/bench_cpu_kernels.py --model CKPT             # bf16, 16 rows, 64 x (128 in, 128 out)
    python scripts/bench_cpu_kernels.py --model CKPT --repeats 3 --variants all_on,all_off
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

KERNELS = ("cpu_bf16_amx", "cpu_bf16_linear", "cpu_bf16_linear_avx2", "cpu_decode_attention", "cpu_layer_ops",
           "cpu_decode_layers")
# no_bf16_linear turns AMX and the AVX2 kernel off too; it, no_decode_attention and no_layer_ops turn the
# one-call decode layers off as well (those call these kernels)
VARIANTS = {"all_on": "", **{f"no_{k.removeprefix('cpu_')}": k for k in KERNELS}, "all_off": ",".join(KERNELS)}


def run(cmd: list[str], forced: str) -> str:
    env = {**os.environ, "L3WORKER_REFERENCE_KERNELS": forced}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    a = p.parse_args()
    names = a.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    common = [*(["--model", a.model] if a.model else []), "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
              "--max-model-len", str(a.input_len + a.output_len + 256)]
    tput = ["l3worker", "bench", "throughput", *common, "--dataset-name", "random", "--random-input-len",
            str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts)]
    lat = ["l3worker", "bench", "latency", *common, "--input-len", str(a.input_len), "--output-len",
           str(a.output_len), "--batch-size", "1", "--num-iters-warmup", "1", "--num-iters", "3"]
    figures: dict[str, dict[str, list[float]]] = {n: {"tok/s": [], "latency s": []} for n in names}
    for r in range(a.repeats):
        for n in names:
            out = run(tput, VARIANTS[n])
            figures[n]["tok/s"].append(float(re.search(r"([\d.]+) output tokens/s", out).group(1)))
            out = run(lat, VARIANTS[n])
            figures[n]["latency s"].append(float(re.search(r"Avg latency: ([\d.]+)", out).group(1)))
            print(f"repeat {r + 1} {n:<22} {figures[n]['tok/s'][-1]:8.1f} tok/s  {figures[n]['latency s'][-1]:6.3f} s",
                  flush=True)
    base = {k: statistics.median(v) for k, v in figures[names[0]].items()}
    print(f"\n{'variant':<22} {'output tok/s':>12} {'ratio':>6} {'batch-1 latency s':>18} {'ratio':>6}")
    for n in names:
        t, l_ = statistics.median(figures[n]["tok/s"]), statistics.median(figures[n]["latency s"])
        print(f"{n:<22} {t:12.1f} {t / base['tok/s']:6.2f} {l_:18.3f} {l_ / base['latency s']:6.2f}")


if __name__ == "__main__":
    main()
