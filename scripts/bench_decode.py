#!/usr/bin/env python
"""Decode benchmark: the in-process floor, the L3 path and HF generate on one model and workload.

Variants, run alternately within each repeat (floor, l3, l3_depth1, l3_always, hf, then again):

  floor      ChipRuntime.execute in a loop in this process: no parent, no IPC
  l3         DistributedWorker at the default pipeline depth (4 on the CPU, 2 on an accelerator)
  l3_depth1  DistributedWorker with one command in flight
  l3_always  DistributedWorker with copy_policy="always"
  hf         transformers generate, best of the static and the dynamic cache

Each reports TPOT p50/p99 (median over repeats of each repeat's figure), the ratio of its p50 to
the floor's, and per decode step the command bytes (p50: the steady state), H2D copies and pool
allocations. Workloads: `overhead` (a tiny model whose decode step takes about 1 ms: the host
path dominates) and `compute` (tens of millions of parameters). Also measured: prompt submission
as a list vs an int32 array (bench_submit.py), and the setup time of the first request vs later ones.

Exit status 1 when any L3 variant's token ids differ from the floor's. Timings are not checked
here: compare ratios from one run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from bench_common import (CpuMeter, Isolated, compute_cores, digest, hf_generate, machine_info,  # scripts/
                          pinned, random_prompts)
from bench_common import Floor as FloorBase
from bench_common import L3 as L3Base
from bench_models import write_random_qwen3  # scripts/, next to this file
from bench_submit import DEFAULT_SIZES, format_submission, measure_submission  # scripts/, next to this file

from chip_child.config import RuntimeConfig
from chip_child.protocol import Command
from chip_child.step.runtime import ChipRuntime

VARIANTS = ("floor", "l3", "l3_depth1", "l3_always", "hf")
L3_VARIANTS = {"l3": dict(pipeline_depth=None, copy_policy="dirty"),
               "l3_depth1": dict(pipeline_depth=1, copy_policy="dirty"),
               "l3_always": dict(pipeline_depth=None, copy_policy="always")}
BASE_MODEL = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  max_position_embeddings=32768, eos_token_id=None, bos_token_id=None, pad_token_id=None)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    model: dict  # Qwen3Config fields on top of BASE_MODEL
    repeats: int
    batch: int = 16
    prompt_len: int = 128
    new_tokens: int = 128
    page_size: int = 128
    max_seq_len: int = 512
    seed: int = 0


WORKLOADS = {
    "overhead": Workload(
        "overhead", "tiny model, ~1 ms decode step at batch 16 / context 256: host overhead dominates",
        dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16), repeats=20),
    "compute": Workload(
        "compute", "tens of millions of parameters: the model's arithmetic dominates",
        dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64), repeats=3),
}


# -- workload ---------------------------------------------------------------------------------------
def write_checkpoint(path: Path, wl: Workload) -> int:
    """A random Qwen3ForCausalLM saved with save_pretrained (fixed seed, no eos); returns its parameter count."""
    return write_random_qwen3(path, {**BASE_MODEL, **wl.model}, wl.seed)


def make_prompts(wl: Workload) -> list[np.ndarray]:
    return random_prompts(wl.batch, wl.prompt_len, wl.model["vocab_size"], wl.seed)


@dataclass
class Run:
    """One variant's one repeat."""

    step_s: list[float]  # per decode step: one token per row
    tokens: np.ndarray  # [batch, new_tokens]
    command_bytes: list[int] = field(default_factory=list)
    h2d_copies: list[int] = field(default_factory=list)
    pool_allocs: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


# -- floor ----------------------------------------------------------------------------------------------
class Floor(FloorBase):
    """The chip runtime's step in a loop (bench_common.Floor); only `rt.execute` is timed, on the
    cores a worker's child would compute on."""

    def __init__(self, model_dir: str, wl: Workload, threads: int):
        self.wl = wl
        self.threads = threads
        with pinned(compute_cores(threads)):  # torch's thread pool starts here and keeps this mask
            rt = ChipRuntime(RuntimeConfig(model_dir, device="cpu", max_batch_size=wl.batch,
                                           max_seq_len=wl.max_seq_len, page_size=wl.page_size, num_threads=threads))
        super().__init__(rt, wl.batch, wl.page_size)

    def run(self, prompts: list[np.ndarray], new_tokens: int) -> Run:
        cmds, staging = self._commands(prompts, new_tokens)
        tokens = np.zeros((len(prompts), len(cmds)), np.int32)
        run = Run(step_s=[], tokens=tokens)
        with pinned(compute_cores(self.threads)):
            self._loop(cmds, staging, tokens, run)
        return run

    def _loop(self, cmds: list[Command], staging: np.ndarray, tokens: np.ndarray, run: Run) -> None:
        for j, cmd in enumerate(cmds):
            t0 = time.perf_counter()
            r = self.rt.execute(cmd, staging, self.out)
            dt = time.perf_counter() - t0
            tokens[:, j] = self.out.numpy()[:len(tokens)]  # rows 0.. hold the prompts
            if not cmd.is_prefill:
                run.step_s.append(dt)
                run.h2d_copies.append(r.h2d_copies)
                run.pool_allocs.append(r.pool_allocs)


# -- l3 ---------------------------------------------------------------------------------------------------
class L3(L3Base):
    def __init__(self, model_dir: str, wl: Workload, threads: int, pipeline_depth: int | None, copy_policy: str):
        # The whole prefill in one step, as the floor sends it: the variants differ in decode alone.
        super().__init__(model_dir, device="cpu", max_batch_size=wl.batch, max_seq_len=wl.max_seq_len,
                         page_size=wl.page_size, pipeline_depth=pipeline_depth, copy_policy=copy_policy,
                         max_num_batched_tokens=wl.batch * wl.prompt_len, num_threads=threads)
        self.setup_s: list[float] = []  # every generate's setup_s; the first includes prepare()

    def run(self, prompts: list[np.ndarray], new_tokens: int) -> Run:
        tokens = self.generate(prompts, new_tokens, seed=0)
        last = self.w.stats()["last_generate"]
        self.setup_s.append(last["setup_s"])
        decode = self.decode_records()
        return Run(
            step_s=[r["parent_wall_s"] for r in decode],
            tokens=tokens,
            command_bytes=[r["command_bytes"] for r in decode],
            h2d_copies=[r["h2d_copies"] for r in decode],
            pool_allocs=[r["pool_allocs"] for r in decode],
            extra={f"{k}_p50": statistics.median(r[k] for r in decode) for k in ("wait_s", "apply_s", "device_s")},
        )


# -- hf ----------------------------------------------------------------------------------------------------
class HFGenerate:
    """transformers generate, greedy, on the cores a worker's child computes on; a logits
    processor stamps every step (bench_common.hf_generate)."""

    def __init__(self, model_dir: str, threads: int):
        from transformers import Qwen3ForCausalLM

        cores = compute_cores(threads)
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, prompts: list[np.ndarray], new_tokens: int, cache: str) -> tuple[list[float], np.ndarray]:
        return hf_generate(self.model, prompts, new_tokens, cache, timed=True)


class HF:
    """HFGenerate with the same prompts as one [batch, prompt_len] tensor (all prompts have the
    same length, so left padding adds nothing); the differences between consecutive stamps are
    the decode steps.

    It runs in a process of its own: an HF generate in the benchmark's process measurably slowed
    the l3 variants measured after it (about 8% on the overhead workload), which would credit
    transformers' state to the path under test."""

    CACHES = ("static", "dynamic")

    def __init__(self, model_dir: str, threads: int):
        self.process = Isolated("hf", HFGenerate, model_dir, threads)

    def run(self, prompts: list[np.ndarray], new_tokens: int, cache: str) -> Run:
        _, (step_s, tokens) = self.process.run(prompts, new_tokens, cache)
        return Run(step_s=step_s, tokens=tokens)

    def close(self) -> None:
        self.process.close()


# -- summaries ---------------------------------------------------------------------------------------------
def summarize(runs: list[Run]) -> dict:
    p50s = [float(np.percentile(r.step_s, 50)) for r in runs]
    p99s = [float(np.percentile(r.step_s, 99)) for r in runs]

    def per_step(attr: str) -> dict | None:
        values = [v for r in runs for v in getattr(r, attr)]
        if not values:
            return None
        return {"p50": float(np.median(values)), "mean": float(np.mean(values)), "max": int(max(values))}

    cb, h2d, allocs = per_step("command_bytes"), per_step("h2d_copies"), per_step("pool_allocs")
    out = {
        "tpot_p50_s": statistics.median(p50s),
        "tpot_p99_s": statistics.median(p99s),
        "ratio_to_floor": None,
        # p50 over every decode step of every repeat: the steady state; mean/max include page boundaries
        "command_bytes_per_step": cb["p50"] if cb else None,
        "h2d_copies_per_step": h2d["p50"] if h2d else None,
        "pool_allocs_per_step": allocs["mean"] if allocs else None,
        "command_bytes": cb, "h2d_copies": h2d, "pool_allocs": allocs,
        "tpot_p50_per_repeat_s": p50s,
        "decode_steps_per_repeat": len(runs[0].step_s),
        "tokens_sha256": digest(runs[0].tokens),
    }
    for key in runs[0].extra:
        out[key] = statistics.median(r.extra[key] for r in runs)
    return out


def fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(variants: dict) -> str:
    lines = [("| variant | tpot p50 (ms) | tpot p99 (ms) | ratio to floor | command bytes/step | h2d copies/step "
              "| pool allocs/step | child apply p50 (ms) |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, v in variants.items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error']} |")
            continue
        cb = v["command_bytes"]
        cb_text = "-" if cb is None else f"{cb['p50']:.0f} (mean {cb['mean']:.1f}, max {cb['max']})"
        h2d = v["h2d_copies"]
        h2d_text = "-" if h2d is None else f"{h2d['p50']:.0f} (mean {h2d['mean']:.3f})"
        label = name + (f" ({v['cache']} cache)" if "cache" in v else "")
        lines.append(f"| {label} | {fmt(v['tpot_p50_s'], 1e3)} | {fmt(v['tpot_p99_s'], 1e3)} "
                     f"| {fmt(v['ratio_to_floor'], digits=3)} | {cb_text} | {h2d_text} "
                     f"| {fmt(v['pool_allocs_per_step'], digits=0)} | {fmt(v.get('apply_s_p50'), 1e3)} |")
    return "\n".join(lines)


# -- one workload -----------------------------------------------------------------------------------------
def bench_workload(wl: Workload, model_dir: str, params: int, threads: int, use_hf: bool) -> dict:
    prompts = make_prompts(wl)
    print(f"\n== workload {wl.name}: {wl.description}\n   {params / 1e6:.2f}M params, batch {wl.batch}, "
          f"prompt {wl.prompt_len}, {wl.new_tokens} new tokens, page {wl.page_size}, {wl.repeats} repeats",
          flush=True)
    runners: dict = {}
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    errors: dict[str, str] = {}
    hf_runs: dict[str, list[Run]] = {c: [] for c in HF.CACHES}
    t_start = time.perf_counter()
    try:
        runners["floor"] = Floor(model_dir, wl, threads)
        for name, kw in L3_VARIANTS.items():
            runners[name] = L3(model_dir, wl, threads, **kw)
        if use_hf:
            try:
                runners["hf"] = HF(model_dir, threads)
            except RuntimeError as exc:  # transformers cannot load it: every cache fails alike
                errors.update({f"hf_{cache}": f"{type(exc).__name__}: {exc}" for cache in HF.CACHES})
        # Warm-up, off the record and short: the first generate prepares each worker (it is the
        # "first request" of the setup figures).
        warm = min(8, wl.new_tokens)
        for name, runner in runners.items():
            if name == "hf":
                for cache in HF.CACHES:
                    try:
                        runner.run(prompts, warm, cache)
                    except Exception as exc:  # a cache kind this transformers cannot do
                        errors[f"hf_{cache}"] = f"{type(exc).__name__}: {exc}"
            else:
                runner.run(prompts, warm)
        meter = CpuMeter([pid for r in runners.values() if isinstance(r, L3) for pid in r.w.child_pids])
        for rep in range(wl.repeats):
            for name, runner in runners.items():
                gc.collect()
                if name == "hf":
                    for cache in HF.CACHES:
                        if f"hf_{cache}" not in errors:
                            hf_runs[cache].append(runner.run(prompts, wl.new_tokens, cache))
                else:
                    runs[name].append(runner.run(prompts, wl.new_tokens))
            print(f"   repeat {rep + 1}/{wl.repeats}: floor p50 {np.median(runs['floor'][-1].step_s) * 1e3:.3f} ms, "
                  f"l3 p50 {np.median(runs['l3'][-1].step_s) * 1e3:.3f} ms", flush=True)
        load = meter.cores()
        setup = runners["l3"].setup_s
        l3_stats = runners["l3"].w.stats()
    finally:
        for runner in runners.values():
            if isinstance(runner, (L3, HF)):
                runner.close()

    variants: dict[str, dict] = {}
    for name in VARIANTS:
        if name == "hf":
            continue
        variants[name] = summarize(runs[name])
    if use_hf:
        cands = {c: summarize(r) for c, r in hf_runs.items() if r}
        if cands:
            best = min(cands, key=lambda c: cands[c]["tpot_p50_s"])
            variants["hf"] = {**cands[best], "cache": best,
                              "candidates": {c: {k: s[k] for k in ("tpot_p50_s", "tpot_p99_s")}
                                             for c, s in cands.items()},
                              "errors": {k: v for k, v in errors.items() if k.startswith("hf_")}}
        else:
            variants["hf"] = {"error": "; ".join(errors.values())}
    floor_p50 = variants["floor"]["tpot_p50_s"]
    for v in variants.values():
        if "tpot_p50_s" in v:
            v["ratio_to_floor"] = v["tpot_p50_s"] / floor_p50

    reference = runs["floor"][0].tokens
    mismatches = [f"{name} repeat {i}" for name in ("floor", *L3_VARIANTS) for i, r in enumerate(runs[name])
                  if not np.array_equal(r.tokens, reference)]
    hf_agree = None
    if use_hf and any(hf_runs.values()):
        hf_tokens = next(r for r in hf_runs.values() if r)[0].tokens
        hf_agree = float((hf_tokens == reference).mean())
    setup_info = {
        "first_setup_s": setup[0], "prepare_s": l3_stats["prepare_s"], "child_setup_s": l3_stats["child_setup_s"],
        "later_setup_s_p50": statistics.median(setup[1:]) if len(setup) > 1 else None,
        "later_setup_s_max": max(setup[1:]) if len(setup) > 1 else None,
    }
    if setup_info["later_setup_s_p50"] is not None:
        setup_info["later_over_first"] = setup_info["later_setup_s_p50"] / setup[0]

    print(format_table(variants))
    if mismatches:
        print(f"TOKEN MISMATCH vs the floor: {', '.join(mismatches)}")
    else:
        print(f"tokens: floor, {', '.join(L3_VARIANTS)} produced identical token ids in every repeat "
              f"(sha256 {digest(reference)})")
    if hf_agree is not None:
        print(f"hf agreement with the floor's tokens: {hf_agree:.1%} (fp32 reductions differ; informational)")
    print(f"setup: first generate {setup_info['first_setup_s'] * 1e3:.1f} ms "
          f"(prepare {setup_info['prepare_s'] * 1e3:.1f} ms), "
          f"later p50 {fmt(setup_info['later_setup_s_p50'], 1e6, 1)} us", flush=True)
    if load:
        print(f"cpu use while timing: this benchmark {load['this_benchmark_cores']:.2f} cores, other processes "
              f"{load['other_processes_cores']:.2f} cores (of {os.cpu_count()})")
    print(f"   workload took {time.perf_counter() - t_start:.0f} s", flush=True)
    return {
        "workload": {**{k: v for k, v in asdict(wl).items() if k != "model"}, "model": {**BASE_MODEL, **wl.model},
                     "params": params, "tpot": "per decode step, each makes one token per row"},
        "variants": variants,
        "tokens_match": not mismatches, "mismatches": mismatches, "hf_token_agreement": hf_agree,
        "setup": setup_info, "cpu_load": load,
    }


# -- targets ------------------------------------------------------------------------------------------------
def targets(result: dict) -> list[dict]:
    out = []

    def add(name: str, value, met: bool | None) -> None:
        out.append({"target": name, "value": value, "met": met})

    ov = result["workloads"].get("overhead")
    if ov:
        v = ov["variants"]
        add("overhead: l3 / floor <= 1.05 (aim 1.03)", v["l3"]["ratio_to_floor"], v["l3"]["ratio_to_floor"] <= 1.05)
        add("overhead: l3_always above l3", v["l3_always"]["ratio_to_floor"],
            v["l3_always"]["tpot_p50_s"] > v["l3"]["tpot_p50_s"])
        add("overhead: l3_depth1 above l3", v["l3_depth1"]["ratio_to_floor"],
            v["l3_depth1"]["tpot_p50_s"] > v["l3"]["tpot_p50_s"])
    for wname, w in result["workloads"].items():
        v = w["variants"]["l3"]
        add(f"{wname}: steady command bytes/step <= 64", v["command_bytes_per_step"], v["command_bytes_per_step"] <= 64)
        add(f"{wname}: steady h2d copies/step == 0", v["h2d_copies_per_step"], v["h2d_copies_per_step"] == 0)
        add(f"{wname}: pool allocs == 0", v["pool_allocs"]["max"], v["pool_allocs"]["max"] == 0)
        s = w["setup"]
        if s.get("later_over_first") is not None:
            add(f"{wname}: later setup < 1% of first", s["later_over_first"], s["later_over_first"] < 0.01)
        hf = w["variants"].get("hf")
        if hf and "tpot_p50_s" in hf:
            ratio = v["tpot_p50_s"] / hf["tpot_p50_s"]
            add(f"{wname}: l3 / hf <= 0.5", ratio, ratio <= 0.5)
    sub = result.get("prompt_submission")
    if sub:
        biggest = max(sub["sizes"], key=lambda r: r["tokens"])
        add(f"submission at {biggest['tokens']} tokens: list / int32 >= 10", biggest["ratio"],
            biggest["ratio"] >= 10 if biggest["tokens"] >= 16384 else None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the overhead workload, 8 repeats (about a minute)")
    ap.add_argument("--workload", choices=("overhead", "compute", "all"), default=None,
                    help="default: all, or overhead with --quick")
    ap.add_argument("--repeats", type=int,
                    help="repeats per workload (default 20 overhead / 3 compute; 8 with --quick)")
    ap.add_argument("--steps", type=int, help="new tokens per request (default 128: context reaches 256)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for the floor, every chip-child and hf (default 1). On this 2-core "
                         "box 1 is best for the overhead workload's floor: its ops are too small to split (2 "
                         "threads: no faster when the box is idle, 10-36 ms instead of 1.5 ms when other "
                         "processes hold a core, because OpenMP workers spin and wait for each other). 2 threads "
                         "speed the compute floor up only on an idle box, and an L3 child with 2 threads "
                         "competes with its own parent, which needs a core for each step's bookkeeping")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--submission-sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="prompt token counts for the submission measurement (empty: skip)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    longest = min(wl.max_seq_len - wl.prompt_len for wl in WORKLOADS.values())
    if args.steps is not None and not 2 <= args.steps <= longest:
        ap.error(f"--steps must be in [2, {longest}] (at least one decode step; prompt + steps within max_seq_len)")

    names = {"overhead": ["overhead"], "compute": ["compute"], "all": ["overhead", "compute"],
             None: ["overhead"] if args.quick else ["overhead", "compute"]}[args.workload]
    use_hf = not args.no_hf
    if use_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: no hf variant")
            use_hf = False
    torch.set_num_threads(args.threads)
    machine = machine_info(python=platform.python_version(), threads=args.threads)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    result: dict = {"machine": machine, "workloads": {}, "setup": {}}
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        for name in names:
            wl = WORKLOADS[name]
            overrides = {}
            if args.quick:
                overrides["repeats"] = 8
            if args.repeats:
                overrides["repeats"] = args.repeats
            if args.steps:
                overrides["new_tokens"] = args.steps
            wl = Workload(**{**asdict(wl), **overrides})
            model_dir = str(Path(tmp) / name)
            params = write_checkpoint(Path(model_dir), wl)
            res = bench_workload(wl, model_dir, params, args.threads, use_hf)
            result["workloads"][name] = res
            result["setup"][name] = res["setup"]
            if name == "overhead" and args.submission_sizes:
                sizes = tuple(int(s) for s in args.submission_sizes.split(","))
                result["prompt_submission"] = measure_submission(model_dir, sizes)
                print("\nprompt submission (Engine.make_request, nothing sent):")
                print(format_submission(result["prompt_submission"]), flush=True)
    result["targets"] = targets(result)
    print("\n| target | value | met |\n| --- | ---: | --- |")
    for t in result["targets"]:
        met = {True: "yes", False: "NO", None: "n/a"}[t["met"]]
        value = t["value"] if not isinstance(t["value"], float) else f"{t['value']:.4g}"
        print(f"| {t['target']} | {value} | {met} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = all(w["tokens_match"] for w in result["workloads"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
