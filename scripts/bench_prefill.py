#!/usr/bin/env python
"""One prompt's prefill in process, the floor of a lone request's time to first token: the chip
runtime (chip_child.local, no parent, no IPC) prefills a random prompt of --input-len tokens and
samples its first token, --repeats times. Printed: the median and best step, and the projections'
share of it, by matrix shape (rows x out x in, the time of each call and per step). Served TTFT
at one client is this plus the server's path; compare it with the prefill steps' `apply_s` in a
step trace (`L3WORKER_STEP_TRACE=FILE l3worker serve ...`).

    python scripts/bench_prefill.py                                   # the built-in model, 128 tokens
    python scripts/bench_prefill.py --model CKPT --dtype bfloat16 --input-len 128 --repeats 10
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere
from chip_child.config import RuntimeConfig  # noqa: E402
from chip_child.device import available_cores  # noqa: E402
from chip_child.local import LocalDriver, LocalRequest  # noqa: E402
from chip_child.models import qwen3  # noqa: E402
from chip_child.models.tiny_model import ensure_tiny_model  # noqa: E402
from chip_child.step.runtime import ChipRuntime  # noqa: E402

WARM_UP = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="default: every core this process may use")
    a = p.parse_args()
    threads = a.threads or available_cores()
    torch.set_num_threads(threads)
    model = a.model or str(ensure_tiny_model())
    rt = ChipRuntime(RuntimeConfig(model, device="cpu", dtype=a.dtype, max_batch_size=1,
                                   max_seq_len=a.input_len + 8, max_prefill_tokens=a.input_len, num_threads=threads))
    vocab = rt.model_cfg.vocab_size
    calls: dict[tuple[int, int, int], list[float]] = collections.defaultdict(list)
    plain = qwen3.linear

    def timed(x, weight_t, bias=None):
        t0 = time.perf_counter()
        y = plain(x, weight_t, bias)
        calls[(x.shape[0], y.shape[-1], x.shape[-1])].append(time.perf_counter() - t0)
        return y

    def prefill() -> float:
        prompt = [random.randrange(vocab) for _ in range(a.input_len)]
        t0 = time.perf_counter()
        LocalDriver(rt).run([LocalRequest(prompt, 1)])
        return time.perf_counter() - t0

    try:
        for _ in range(WARM_UP):
            prefill()
        qwen3.linear = timed
        steps = [prefill() for _ in range(a.repeats)]
    finally:
        qwen3.linear = plain
        rt.close()
    print(f"prefill of {a.input_len} tokens, {a.dtype}, {threads} threads, {Path(model).name}: "
          f"median {statistics.median(steps) * 1e3:.2f} ms, best {min(steps) * 1e3:.2f} ms "
          f"(projections timed, so slightly slower than untimed)")
    total = 0.0
    for (rows, out, inp), times in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        per_step = sum(times) / a.repeats
        total += per_step
        print(f"  {rows:>5} x {out:>6} x {inp:>5}: {statistics.median(times) * 1e3:7.3f} ms a call, "
              f"{per_step * 1e3:7.2f} ms a step")
    print(f"  projections: {total * 1e3:.2f} ms a step")


if __name__ == "__main__":
    main()
