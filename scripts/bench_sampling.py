#!/usr/bin/env python
"""What the optional sampling stages cost per decode step, in-process (ChipRuntime.execute in a
loop, as bench_decode.py's floor: no parent, no IPC), on bench_decode's two models.

Variants, run alternately within each repeat, every row seeded with temperature 0.8 so that
min_p has something to filter:

  off        none of the stages: the plain sampler
  penalties  presence 0.5, frequency 0.5, repetition 1.2
  logprobs   logprobs=20 for every row (written into host outputs each step, as rank 0 does)
  min_p      min_p 0.05
  all        all of the above, plus min_tokens over the whole run with two stop ids and
             prompt_logprobs=20 (the prompt's cost is in the prefill column, not the step)

Each reports the decode step's p50 (median over repeats of each repeat's p50), its ratio to
`off`, and the prefill's time. A second table times the sampler alone on [batch, vocab] logits
(what each variant adds to a step whatever the model; on a shared machine far steadier than a
large model's step). Timings are not checked: compare ratios from one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import CpuMeter, compute_cores, pinned  # scripts/, next to this file
from bench_decode import WORKLOADS, Floor, Workload, make_prompts, write_checkpoint

from chip_child.protocol import Admit, Command
from chip_child.step.row_fields import MAX_LOGPROBS
from chip_child.step.runtime import StepOutputs
from chip_child.sampling.noise import vocab_hash
from chip_child.sampling.sampler import Features, RowParams, sample, sample_with_features, seed_key

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
VARIANTS = {
    "off": {},
    "penalties": PENALTIES,
    "logprobs": dict(logprobs=MAX_LOGPROBS),
    "min_p": dict(min_p=0.05),
    "all": dict(**PENALTIES, logprobs=MAX_LOGPROBS, min_p=0.05, min_tokens=None, stop_ids=(1, 2),
                prompt_logprobs=MAX_LOGPROBS),
}
LARGER = "compute"  # bench_decode's compute-dominated model


class Loop(Floor):
    """bench_decode's floor with every row seeded at temperature 0.8 and the variant's stages on;
    each run admits the batch in one prefill, then decodes it to new_tokens."""

    def __init__(self, model_dir: str, wl: Workload, threads: int):
        super().__init__(model_dir, wl, threads)
        self.outputs = StepOutputs.allocate(wl.batch, self.rt.cfg.prefill_capacity)

    def _stage_commands(self, prompts: list[np.ndarray], features: dict) -> tuple[list[Command], np.ndarray]:
        extra = dict(features)
        if "min_tokens" in extra:
            extra["min_tokens"] = self.wl.new_tokens
            extra["stop_ids"] = np.array(extra["stop_ids"], np.int32)
        admits = [Admit(row, len(p), 0.8, 1.0, 0, row, **extra) for row, p in enumerate(prompts)]
        return self._commands(prompts, self.wl.new_tokens, admits)

    def run(self, prompts: list[np.ndarray], features: dict) -> tuple[list[float], float, np.ndarray]:
        cmds, staging = self._stage_commands(prompts, features)
        steps, tokens = [], np.zeros((len(prompts), len(cmds)), np.int32)
        with pinned(compute_cores(self.threads)):
            for j, cmd in enumerate(cmds):
                t0 = time.perf_counter()
                self.rt.execute(cmd, staging, self.out, self.outputs)
                dt = time.perf_counter() - t0
                tokens[:, j] = self.out.numpy()
                if cmd.is_prefill:
                    prefill = dt
                else:
                    steps.append(dt)
        return steps, prefill, tokens


STAGES = {"off": None, "penalties": Features(penalties=True), "logprobs": Features(logprobs=MAX_LOGPROBS),
          "min_p": Features(min_p=True),
          "all": Features(penalties=True, min_p=True, stop_mask=True, logprobs=MAX_LOGPROBS)}


def sampler_alone(batch: int, vocab: int, threads: int, rounds: int = 30, calls: int = 20) -> dict[str, float]:
    """p50 seconds of one step's sampling (and, with penalties, the device update of the output
    counts) per variant, on random logits, rows seeded at temperature 0.8; variants alternate."""
    g = torch.Generator().manual_seed(0)
    n = torch.full((batch,), 1.0)
    logits = torch.randn(batch, vocab, generator=g)
    counts = torch.randint(0, 2, (batch, vocab), generator=g).float()
    params = RowParams(temperature=n * 0.8, top_k=torch.zeros(batch, dtype=torch.int64), top_p=n.clone(),
                       keys=torch.tensor([seed_key(i) for i in range(batch)]), min_p=n * 0.05, presence=n * 0.5,
                       frequency=n * 0.5, repetition=n * 1.2, min_pos=torch.full((batch,), 1 << 20),
                       output_counts=counts, prompt_seen=(torch.rand(batch, vocab, generator=g) < 0.01).float(),
                       stop_mask=torch.zeros(batch, vocab, dtype=torch.bool))
    params.stop_mask[:, :2] = True
    counters, vocab_keys = torch.full((batch,), 200), vocab_hash(vocab, torch.device("cpu"))
    values, ids = torch.zeros(batch, 1 + MAX_LOGPROBS), torch.zeros(batch, MAX_LOGPROBS, dtype=torch.int64)
    active = torch.ones(batch, dtype=torch.bool)
    times: dict[str, list[float]] = {v: [] for v in STAGES}

    def one(features: Features | None) -> None:
        if features is None:
            sample(logits, params.temperature, params.top_k, params.top_p, params.keys, counters, vocab_keys,
                   True, False)
            return
        out = sample_with_features(logits, params, counters, vocab_keys, True, False, features, values, ids)
        if features.penalties:
            counts.scatter_add_(1, out[:, None], active[:, None].to(counts.dtype))

    with pinned(compute_cores(threads)), torch.inference_mode():
        for _ in range(rounds):
            for variant, features in STAGES.items():
                for _ in range(calls):
                    t0 = time.perf_counter()
                    one(features)
                    times[variant].append(time.perf_counter() - t0)
    return {v: float(np.percentile(t, 50)) for v, t in times.items()}


def bench(name: str, wl: Workload, model_dir: str, threads: int) -> dict:
    print(f"\n== {name}: {wl.description}; batch {wl.batch}, prompt {wl.prompt_len}, {wl.new_tokens} new tokens, "
          f"{wl.repeats} repeats", flush=True)
    loop = Loop(model_dir, wl, threads)
    prompts = make_prompts(wl)
    for features in VARIANTS.values():  # warm every path once, untimed
        loop.run(prompts, features)
    step_p50s = {v: [] for v in VARIANTS}
    prefill = {v: [] for v in VARIANTS}
    first_tokens: dict[str, np.ndarray] = {}
    meter = CpuMeter([])
    for rep in range(wl.repeats):
        for variant, features in VARIANTS.items():
            gc.collect()
            steps, pre, tokens = loop.run(prompts, features)
            step_p50s[variant].append(float(np.percentile(steps, 50)))
            prefill[variant].append(pre)
            if variant in first_tokens and not np.array_equal(first_tokens[variant], tokens):
                raise SystemExit(f"{variant}: tokens differ between repeats")
            first_tokens.setdefault(variant, tokens)
        print(f"   repeat {rep + 1}/{wl.repeats}: " + ", ".join(f"{v} {step_p50s[v][-1] * 1e3:.3f} ms"
                                                              for v in VARIANTS), flush=True)
    load = meter.cores()
    off = statistics.median(step_p50s["off"])
    rows = {v: {"step_p50_s": statistics.median(step_p50s[v]), "prefill_s": statistics.median(prefill[v])}
            for v in VARIANTS}
    print("| variant | decode step p50 (ms) | ratio to off | prefill p50 (ms) |\n| --- | ---: | ---: | ---: |")
    for v, r in rows.items():
        r["ratio"] = r["step_p50_s"] / off
        print(f"| {v} | {r['step_p50_s'] * 1e3:.3f} | {r['ratio']:.3f} | {r['prefill_s'] * 1e3:.2f} |")
    if load:
        print(f"cpu use while timing: this benchmark {load['this_benchmark_cores']:.2f} cores, other processes "
              f"{load['other_processes_cores']:.2f} cores")
    loop.rt.close()
    alone = sampler_alone(wl.batch, wl.model["vocab_size"], threads)
    print(f"\nthe sampler alone on [{wl.batch}, {wl.model['vocab_size']}] logits:")
    print("| variant | sampling p50 (ms) | added to a step (ms) |\n| --- | ---: | ---: |")
    for v, t in alone.items():
        rows[v]["sampler_alone_s"] = t
        print(f"| {v} | {t * 1e3:.3f} | {(t - alone['off']) * 1e3:+.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("overhead", LARGER, "all"), default="all")
    ap.add_argument("--repeats", type=int, help="default: 8 overhead, 3 compute")
    ap.add_argument("--steps", type=int, help="new tokens per request (default: 128 overhead, 32 compute)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as bench_decode)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["overhead", LARGER] if args.workload == "all" else [args.workload]
    defaults = {"overhead": dict(repeats=8, new_tokens=128), LARGER: dict(repeats=3, new_tokens=32)}
    with tempfile.TemporaryDirectory(prefix="bench-sampling-") as tmp:
        for name in names:
            overrides = dict(defaults[name])
            if args.repeats:
                overrides["repeats"] = args.repeats
            if args.steps:
                overrides["new_tokens"] = args.steps
            wl = dataclasses.replace(WORKLOADS[name], **overrides)
            model_dir = str(Path(tmp) / name)
            params = write_checkpoint(Path(model_dir), wl)
            print(f"model {name}: {params / 1e6:.2f}M parameters, vocab {wl.model['vocab_size']}", flush=True)
            bench(name, wl, model_dir, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
