#!/usr/bin/env python
"""The host's own work in a bf16 cpu decode step: the chip runtime's step at batch 1 in a loop in
this process (the benchmarks' floor: no parent, no IPC), split into the one C call that runs every
layer (chip_child.cpu_kernels.decode_layers), the lm_head on the step team (in the greedy head's
one C call with the final norm and the pick, where that runs), and the rest: Python, torch's
dispatch and the sampler, which the model does not need and a small model pays for at every token.

    python scripts/bench_step_host.py --model ../peers/ck-27m --repeats 6
    PYTHONPATH=../base python scripts/bench_step_host.py --model ...   # another checkout, to alternate with

Each repeat generates --new-tokens tokens after a --prompt-len prompt and prints the decode steps'
p50 and, per step on average, the layers' call, the lm_head and the rest, in ms; then the medians
over repeats and the tokens' digest (the same in every repeat and every checkout, or the split is
not comparable). Timings are not checked: compare figures from runs alternated on one machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Floor, compute_cores, digest, pinned  # noqa: E402


class Timed:
    """Seconds spent in the decode layers' C call and in the team's lm_head or the greedy head, summed."""

    def __init__(self, layers) -> None:
        self.layers_s = self.head_s = 0.0
        lib, head = layers.lib, layers._team_lm_head

        class Lib:  # the library with its one-call entry timed
            def __getattr__(_, name):
                return getattr(lib, name)

            def l3_decode_layers(_, *args):
                t0 = time.perf_counter()
                lib.l3_decode_layers(*args)
                self.layers_s += time.perf_counter() - t0

            def l3_decode_head(_, *args):  # the final norm, the lm_head and the greedy pick
                t0 = time.perf_counter()
                lib.l3_decode_head(*args)
                self.head_s += time.perf_counter() - t0

        def timed_head(x):
            t0 = time.perf_counter()
            y = head(x)
            self.head_s += time.perf_counter() - t0
            return y

        layers.lib, layers._team_lm_head = Lib(), timed_head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Qwen3 checkpoint the one-call decode layers take")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from chip_child.step.runtime import ChipRuntime, RuntimeConfig

    page = 128
    with pinned(compute_cores(args.threads)):  # torch's thread pool starts here and keeps this mask
        rt = ChipRuntime(RuntimeConfig(args.model, device="cpu", dtype="bfloat16", max_batch_size=1, page_size=page,
                                       max_seq_len=-(-(args.prompt_len + args.new_tokens) // page) * page,
                                       num_threads=args.threads))
    try:
        if rt.decode_layers is None or rt.decode_layers.refused:
            print("the one-call decode layers do not run here (chip-child's message above says why)", file=sys.stderr)
            return 2
        timed = Timed(rt.decode_layers)
        floor = Floor(rt, 1, page)
        prompt = [np.arange(5, 5 + args.prompt_len, dtype=np.int32) % rt.model_cfg.vocab_size]
        rows, digests = [], set()
        for r in range(args.repeats):
            cmds, staging = floor._commands(prompt, args.new_tokens)
            tokens, steps = [], []
            timed.layers_s = timed.head_s = 0.0
            with pinned(compute_cores(args.threads)):
                for cmd in cmds:
                    t0 = time.perf_counter()
                    rt.execute(cmd, staging, floor.out)
                    if not cmd.is_prefill:
                        steps.append(time.perf_counter() - t0)
                    tokens.append(int(floor.out[0]))
            n = len(steps)
            layers, head = timed.layers_s / n, timed.head_s / n
            row = (statistics.median(steps), layers, head, sum(steps) / n - layers - head)
            rows.append(row)
            digests.add(digest(np.array(tokens)))
            print(f"repeat {r + 1}: step p50 {row[0] * 1e3:.3f} ms, per step: layers {row[1] * 1e3:.3f}, "
                  f"lm_head {row[2] * 1e3:.3f}, the rest {row[3] * 1e3:.3f}", flush=True)
        med = [statistics.median(col) * 1e3 for col in zip(*rows)]
        print(f"median of {args.repeats}: step p50 {med[0]:.3f} ms, layers {med[1]:.3f}, lm_head {med[2]:.3f}, "
              f"the rest {med[3]:.3f}; tokens {','.join(sorted(digests))}")
        return 0 if len(digests) == 1 else 1
    finally:
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
