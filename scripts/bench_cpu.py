#!/usr/bin/env python
"""CPU benchmark: l3 against transformers on small models, prefill included.

What a CPU user compares: the wall time of one whole generate call (prefill and decode) divided
by the output tokens it produced, fp32, greedy, the same prompts for every variant. Variants,
each in a process of its own and run alternately within each repeat:

  l3          DistributedWorker with the defaults a user gets (only max_batch_size set): the
              child prefers one of the layouts below by the model's size and keeps it unless a
              start-up trial shows the other clearly faster (chip_child.cpu_layout)
  l3_every    l3 with cpu_layout="every_core": every core to the child, the parent sleeps
  l3_spare    l3 with cpu_layout="spare_core": the child pinned, a core left for the parent and
              the socket threads
  l3_prefill  l3 with max_num_batched_tokens=2048: the whole prompt batch in one step instead
              of chunks of the default token budget
  l3_<name>   DistributedWorker with options given by --l3 NAME:KEY=VALUE,... (see below)
  floor       (--floor) the chip runtime's loop in one process: no parent, no IPC, every core
  hf_static   transformers generate, static cache, torch's default thread count, one padded batch
  hf_dynamic  the same with the dynamic cache
  hf_batch    transformers' continuous batching, model.generate_batch(inputs=[ids, ...]),
              with a KV cache sized for the workload (its default sizes the cache from the
              machine's RAM and zeroes it on every call)

Prompts have lengths spread around --prompt-len; transformers' generate gets them left-padded
into one batch, generate_batch and l3 get them as they are. Every request makes exactly
--new-tokens tokens (no eos). Reported per variant: the median over repeats of ms per output
token, its ratio to l3, to the best of hf_static/hf_dynamic, and to hf_batch.

Extra l3 variants: `--l3 'nap:spin_wait_s=0'` passes keyword arguments to DistributedWorker
(Python literals); `env.NAME=VALUE` sets an environment variable for that variant's process and
its chip-child (e.g. `--l3 'passive:env.OMP_WAIT_POLICY=PASSIVE'`).

Timings are not checked here: compare ratios from one run. Before each timed run the benchmark
waits for other processes to go quiet (--quiet-wait), and runs again a run during which they kept
more than --max-other cores busy (up to --retries times); the table shows that load and how many
runs were rerun. `--contend N` instead keeps N busy-looping processes running while timing: how
the variants behave when something else wants the cores.
"""
from __future__ import annotations

import argparse
import ast
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from bench_common import L3, Isolated, busy_cores, cpu_seconds, hf_generate, machine_info  # scripts/, next to this
from bench_models import write_random_qwen3  # scripts/, next to this file

BASE_MODEL = dict(tie_word_embeddings=False, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)


@dataclass(frozen=True)
class Workload:
    name: str
    model: dict  # Qwen3Config fields on top of BASE_MODEL
    batch: int = 16
    prompt_len: int = 100  # mean; lengths spread over +-prompt_spread
    prompt_spread: int = 16
    new_tokens: int = 32
    seed: int = 0


WORKLOADS = {
    "small": Workload("small", dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "small_b8": Workload("small_b8", dict(vocab_size=4096, hidden_size=256, intermediate_size=768,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=64), batch=8),
    "wide": Workload("wide", dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=64)),
    "deep": Workload("deep", dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32), batch=12),
    "tiny": Workload("tiny", dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)),
}
DEFAULT_WORKLOADS = ("small", "wide")
HF_VARIANTS = ("hf_static", "hf_dynamic", "hf_batch")


def write_checkpoint(path: Path, wl: Workload) -> int:
    return write_random_qwen3(path, {**BASE_MODEL, **wl.model}, wl.seed)


def make_prompts(wl: Workload) -> list[list[int]]:
    rng = np.random.default_rng(wl.seed)
    lo, hi = max(1, wl.prompt_len - wl.prompt_spread), wl.prompt_len + wl.prompt_spread
    return [rng.integers(0, wl.model["vocab_size"], int(rng.integers(lo, hi + 1))).tolist() for _ in range(wl.batch)]


# -- variants, each served in a process of its own ----------------------------------------------------
class L3Runner(L3):
    def __init__(self, model_dir: str, wl: Workload, options: dict):
        super().__init__(model_dir, device="cpu", max_batch_size=wl.batch, **options)
        self.w.prepare()
        self.wl = wl

    def run(self, prompts: list[list[int]]) -> np.ndarray:
        return self.generate(prompts, self.wl.new_tokens)

    def info(self) -> dict:
        s = self.w.stats()
        return {"child_threads": s["child_threads"], "child_cores": s["child_cores"], "pids": s["child_pids"],
                "spin_s": self.w._doorbell.spin_s, "cpu_layout": s["cpu_layout"],
                "cpu_layout_preferred": s["cpu_layout_preferred"],
                "cpu_layout_other_cores": s["cpu_layout_other_cores"],
                "cpu_layout_step_ms": {layout: {k: round(v * 1e3, 3) for k, v in t.items()}
                                       for layout, t in (s["cpu_layout_step_s"] or {}).items()},
                "cpu_layout_trial_ms": s["cpu_layout_trial_s"] and round(s["cpu_layout_trial_s"] * 1e3, 1)}


class FloorRunner:
    """The chip runtime's loop in this process (chip_child.local): no parent, no IPC, the whole
    prompt batch in one prefill, every core for torch's threads (where the time goes, not a
    variant a user runs)."""

    def __init__(self, model_dir: str, wl: Workload):
        import torch

        from chip_child.config import RuntimeConfig
        from chip_child.device import available_cores
        from chip_child.local import LocalDriver
        from chip_child.step.runtime import ChipRuntime

        self.wl = wl
        capacity = wl.batch * (wl.prompt_len + wl.prompt_spread)
        torch.set_num_threads(available_cores())
        self.rt = ChipRuntime(RuntimeConfig(model_dir, device="cpu", max_batch_size=wl.batch, max_seq_len=4096,
                                            max_prefill_tokens=capacity, num_threads=available_cores()))
        self.driver = LocalDriver(self.rt)

    def run(self, prompts: list[list[int]]) -> np.ndarray:
        from chip_child.local import LocalRequest

        result = self.driver.run([LocalRequest(p, self.wl.new_tokens) for p in prompts])
        return np.array(result.token_ids, np.int32)

    def info(self) -> dict:
        import torch

        return {"threads": torch.get_num_threads(), "pids": []}

    def close(self) -> None:
        self.rt.close()


class HFRunner:
    def __init__(self, model_dir: str, wl: Workload, kind: str):
        import torch
        from transformers import Qwen3ForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # eos warnings on every call
        self.wl, self.kind = wl, kind
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, prompts: list[list[int]]) -> np.ndarray:
        from transformers import GenerationConfig

        n = self.wl.new_tokens
        if self.kind == "hf_batch":
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            page = 64
            blocks = len(prompts) * -(-(max(map(len, prompts)) + n) // page) + 4
            gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            out = self.model.generate_batch(
                inputs=prompts, generation_config=gen,
                continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=blocks))
            return np.array([list(o.generated_tokens)[:n] for o in out.values()], np.int32)
        return hf_generate(self.model, prompts, n, self.kind.removeprefix("hf_"))[1]

    def info(self) -> dict:
        import torch

        return {"threads": torch.get_num_threads(), "pids": []}

    def close(self) -> None:
        pass


def make_runner(name: str, model_dir: str, wl: Workload, options: dict):
    if name in HF_VARIANTS:
        return HFRunner(model_dir, wl, name)
    if name == "floor":
        return FloorRunner(model_dir, wl)
    return L3Runner(model_dir, wl, options)


def variant(name: str, model_dir: str, wl: Workload, options: dict | None = None, env: dict | None = None) -> Isolated:
    """The variant's runner in a process of its own; `env` is set there before torch is imported."""
    return Isolated(name, make_runner, name, model_dir, wl, options or {}, env=env)


# -- measuring ---------------------------------------------------------------------------------------------
def wait_quiet(max_wait_s: float, threshold: float = 0.15, window_s: float = 0.5) -> float | None:
    """Waits (at most max_wait_s) until other processes keep less than `threshold` of a core busy
    over `window_s` (nothing of this benchmark runs meanwhile); returns the last load seen."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        a = busy_cores()
        time.sleep(window_s)
        b = busy_cores()
        if a is None or b is None:
            return None
        load = (b[0] - a[0]) / (b[1] - a[1])
        if load < threshold or time.perf_counter() > deadline:
            return load


def bench_workload(wl: Workload, model_dir: str, params: int, l3_variants: dict[str, tuple[dict, dict]],
                   hf: tuple[str, ...], repeats: int, quiet_wait_s: float, max_other: float, retries: int,
                   floor: bool = False) -> dict:
    prompts = make_prompts(wl)
    out_tokens = wl.batch * wl.new_tokens
    print(f"\n== {wl.name}: {params / 1e6:.2f}M params ({wl.model['num_hidden_layers']} layers, hidden "
          f"{wl.model['hidden_size']}, intermediate {wl.model['intermediate_size']}, vocab {wl.model['vocab_size']}), "
          f"batch {wl.batch}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{wl.new_tokens} new tokens, {repeats} repeats", flush=True)
    variants: dict[str, Isolated] = {}
    times: dict[str, list[float]] = {}
    tokens: dict[str, np.ndarray] = {}
    errors: dict[str, str] = {}
    t_start = time.perf_counter()
    try:
        for name, (options, env) in l3_variants.items():
            variants[name] = variant(name, model_dir, wl, options, env)
        for name in (("floor",) if floor else ()) + hf:
            try:
                variants[name] = variant(name, model_dir, wl)
            except RuntimeError as exc:
                errors[name] = str(exc)
        for name, v in list(variants.items()):  # warm-up, off the record
            try:
                v.run(prompts)
            except RuntimeError as exc:
                errors[name] = str(exc)
                variants.pop(name).close()
        times = {name: [] for name in variants}
        others = {name: [] for name in variants}
        discarded = {name: 0 for name in variants}
        cpu = {name: [0.0, 0.0] for name in variants}  # kept runs' CPU seconds: runner process, its chip-children
        for rep in range(repeats):
            order = list(variants.items())
            if rep % 2:
                order.reverse()  # no variant always follows the same one
            for name, v in order:
                for attempt in range(1 + retries):
                    if quiet_wait_s:
                        wait_quiet(quiet_wait_s)
                    b0, p0, k0 = busy_cores(), cpu_seconds(v.pids[:1]), cpu_seconds(v.pids[1:])
                    dt, toks = v.run(prompts)
                    b1, p1, k1 = busy_cores(), cpu_seconds(v.pids[:1]), cpu_seconds(v.pids[1:])
                    c0, c1 = p0 + k0, p1 + k1
                    # Cores other processes kept busy meanwhile (tick-granular: rough).
                    other = max(b1[0] - b0[0] - (c1 - c0), 0.0) / (b1[1] - b0[1]) if b0 and b1 else 0.0
                    if other <= max_other:
                        break
                    discarded[name] += 1
                others[name].append(other)
                cpu[name][0] += p1 - p0
                cpu[name][1] += k1 - k0
                times[name].append(dt / out_tokens)
                tokens.setdefault(name, toks)
            print(f"   repeat {rep + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.3f}" for n in variants)
                  + " ms/token; other processes " + ", ".join(f"{others[n][-1]:.2f}" for n in variants if others[n])
                  + " cores", flush=True)
        infos = {name: v.info for name, v in variants.items()}
    finally:
        for v in variants.values():
            v.close()

    rows: dict[str, dict] = {}
    for name, ts in times.items():
        rows[name] = {"ms_per_token": statistics.median(ts) * 1e3, "ms_per_token_per_repeat": [t * 1e3 for t in ts],
                      "other_cores": statistics.median(others[name]) if others[name] else None,
                      "other_cores_max": max(others[name]) if others[name] else None,
                      "discarded_runs": discarded[name],
                      # Summed over the kept runs: /proc's clock ticks are too coarse for one run.
                      "process_cpu_us_per_token": cpu[name][0] / (len(ts) * out_tokens) * 1e6,
                      "children_cpu_us_per_token": cpu[name][1] / (len(ts) * out_tokens) * 1e6,
                      "info": infos.get(name)}
    l3_ms = rows["l3"]["ms_per_token"] if "l3" in rows else None
    hf_best = min((rows[n]["ms_per_token"], n) for n in ("hf_static", "hf_dynamic") if n in rows) \
        if any(n in rows for n in ("hf_static", "hf_dynamic")) else None
    batch_ms = rows["hf_batch"]["ms_per_token"] if "hf_batch" in rows else None
    for name, r in rows.items():
        ms = r["ms_per_token"]
        r["tokens_per_s"] = 1e3 / ms
        r["vs_l3"] = ms / l3_ms if l3_ms else None
        r["vs_hf_best_generate"] = ms / hf_best[0] if hf_best else None
        r["vs_hf_batch"] = ms / batch_ms if batch_ms else None
    l3_names = [n for n in l3_variants if n in tokens]
    same = all(np.array_equal(tokens[n], tokens[l3_names[0]]) for n in l3_names) if l3_names else None
    agreement = {n: float((tokens[n] == tokens[l3_names[0]]).mean()) for n in ("floor", *hf) if n in tokens
                 and tokens[n].shape == tokens[l3_names[0]].shape} if l3_names else {}

    print(format_table(rows, hf_best))
    print(f"tokens: l3 variants identical: {same}; agreement with l3 (hf: fp32 reductions differ): "
          + ", ".join(f"{n} {a:.1%}" for n, a in agreement.items()))
    for name, info in infos.items():
        print(f"   {name}: {info}")
    if errors:
        print("errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    print(f"   workload took {time.perf_counter() - t_start:.0f} s", flush=True)
    return {"workload": {**asdict(wl), "model": {**BASE_MODEL, **wl.model}, "params": params,
                         "prompt_lens": [len(p) for p in prompts], "output_tokens": out_tokens},
            "variants": rows, "hf_best_generate": hf_best[1] if hf_best else None, "l3_tokens_identical": same,
            "token_agreement_with_l3": agreement, "errors": errors}


def format_table(rows: dict, hf_best) -> str:
    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    best = f"hf best generate ({hf_best[1]})" if hf_best else "hf best generate"
    lines = [f"| variant | ms/token (median) | tokens/s | / l3 | / {best} | / hf_batch | CPU us/token: process, "
             "chip-children | other load (cores): median, max | runs rerun |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {f(r['ms_per_token'])} | {f(r['tokens_per_s'], 0)} | {f(r['vs_l3'])} "
                     f"| {f(r['vs_hf_best_generate'])} | {f(r['vs_hf_batch'])} | {f(r['process_cpu_us_per_token'], 0)}, "
                     f"{f(r['children_cpu_us_per_token'], 0)} | {f(r['other_cores'], 2)}, "
                     f"{f(r['other_cores_max'], 2)} | {r['discarded_runs']} |")
    return "\n".join(lines)


def parse_l3(specs: list[str]) -> dict[str, tuple[dict, dict]]:
    """NAME:KEY=VALUE,... -> {"l3_NAME": (worker keyword arguments, environment)}."""
    out: dict[str, tuple[dict, dict]] = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        options, env = {}, {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key.startswith("env."):
                env[key[4:]] = value
            else:
                try:
                    options[key] = ast.literal_eval(value)
                except (ValueError, SyntaxError):
                    options[key] = value
        out[f"l3_{name}"] = (options, env)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                    help=f"repeatable (default: {', '.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, help="rows (default: the workload's, 16 or fewer)")
    ap.add_argument("--prompt-len", type=int, help="mean prompt length (default 100)")
    ap.add_argument("--new-tokens", type=int, help="tokens per request (default 32)")
    ap.add_argument("--l3", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="an extra l3 variant (repeatable); see the description")
    ap.add_argument("--only-l3-default", action="store_true",
                    help="of the built-in l3 variants time only l3 (extra --l3 variants still run)")
    ap.add_argument("--floor", action="store_true",
                    help="also time the chip runtime's loop in one process (no parent, no IPC, every core)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--hf", default=",".join(HF_VARIANTS), help="which transformers variants")
    ap.add_argument("--quiet-wait", type=float, default=5.0, metavar="S",
                    help="before each timed run wait up to S seconds for other processes to go quiet (0: never)")
    ap.add_argument("--max-other", type=float, default=0.2, metavar="CORES",
                    help="a run during which other processes kept more than this many cores busy is run again")
    ap.add_argument("--retries", type=int, default=3, help="how many times such a run is run again (then kept)")
    ap.add_argument("--contend", type=int, default=0, metavar="N",
                    help="keep N busy-looping processes running while timing (no quiet wait, no reruns)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    hf = () if args.no_hf else tuple(n for n in args.hf.split(",") if n)
    if any(n not in HF_VARIANTS for n in hf):
        ap.error(f"--hf takes names from {HF_VARIANTS}")
    from chip_child.device import available_cores

    l3_variants = {"l3": ({}, {})}
    if available_cores() > 1:
        l3_variants.update(l3_every=({"cpu_layout": "every_core"}, {}), l3_spare=({"cpu_layout": "spare_core"}, {}))
    l3_variants["l3_prefill"] = ({"max_num_batched_tokens": 2048}, {})
    if args.only_l3_default:
        l3_variants = {"l3": ({}, {})}
    l3_variants.update(parse_l3(args.l3))
    machine = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    result: dict = {"machine": machine, "l3_variants": {k: {"options": o, "env": e} for k, (o, e) in
                                                         l3_variants.items()}, "workloads": {}}
    overrides = {k: v for k, v in (("batch", args.batch), ("prompt_len", args.prompt_len),
                                   ("new_tokens", args.new_tokens)) if v is not None}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.contend)]
    if hogs:
        args.quiet_wait, args.max_other = 0.0, float("inf")
        result["contending_processes"] = len(hogs)
    try:
        run_workloads(args, l3_variants, hf, overrides, result)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    same = all(w["l3_tokens_identical"] in (True, None) for w in result["workloads"].values())
    return 0 if same else 1


def run_workloads(args, l3_variants: dict, hf: tuple[str, ...], overrides: dict, result: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        for name in args.workload or DEFAULT_WORKLOADS:
            wl = Workload(**{**asdict(WORKLOADS[name]), **overrides})
            model_dir = str(Path(tmp) / name)
            params = write_checkpoint(Path(model_dir), wl)
            result["workloads"][name] = bench_workload(wl, model_dir, params, l3_variants, hf, args.repeats,
                                                        args.quiet_wait, args.max_other, args.retries, args.floor)


if __name__ == "__main__":
    sys.exit(main())
