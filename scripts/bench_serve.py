"""Serving benchmark runs around `l3worker bench serve` (l3worker/bench/, vLLM's `bench serve` flags and
result fields), with what only this checkout needs: --launch starts `l3worker serve` on a free port and
stops it after; --offline first runs the same prompts through DistributedWorker.generate (same model
and batch size) and reports served ITL p50 / offline TPOT p50; --repeats alternates the two;
--idle-cpu-s measures the idle server's CPU first; the server's gauges are read after the run, and
its prefix-cache counters around each run (the hit rate, summed over data-parallel engines).

  # against a running server (the same as `l3worker bench serve --base-url ...`, plus the gauges)
  python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20

  # start `l3worker serve`, compare with the offline worker, stop it
  python scripts/bench_serve.py --launch --offline --max-num-seqs 16 --max-concurrency 16 --num-prompts 64

  # data parallel on a shared-prefix workload: one routing per launch
  for r in cache_aware least_loaded round_robin; do python scripts/bench_serve.py --launch \
    --serve-args "--data-parallel-size 2 --data-parallel-routing $r" --dataset-name prefix_repetition ...; done

Defaults differ from `l3worker bench serve` where this script's figures were taken with them: 200
prompts of 128 random tokens, 128 new tokens, temperature 0. Timings are the client's: run the
client and server on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from l3worker.bench.checks import check_serve, parse_percentile_metrics, parse_percentiles
from l3worker.bench.cli import add_serve_args
from l3worker.bench.commands import base_url_of, serve_once, serve_samples
from l3worker.bench.datasets import SampleRequest
from l3worker.bench.metrics import report_lines
from l3worker.bench.serve import first_model
from l3worker.serving.engine_core import STEP_TRACE_ENV
from step_breakdown import print_breakdowns

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"ready at (http://\S+) serving (\S+)")


SCRAPED = ("l3worker:num_requests_running", "l3worker:num_requests_waiting", "l3worker:kv_cache_usage_perc",
           "l3worker:prefix_cache_hits_total", "l3worker:prefix_cache_queries_total")


def scrape(base_url: str) -> dict:
    """The server's l3worker gauges and prefix-cache counters, summed over its engines (the
    `engine` label), where it exports them."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        name = parts[0].split("{")[0] if len(parts) == 2 else None
        if name in SCRAPED:
            found[name] = found.get(name, 0.0) + float(parts[1])
    return found


def prefix_hit_rate(before: dict, after: dict) -> float | None:
    """Prompt tokens the prefix caches supplied over those looked up, between two scrapes."""
    hits, queries = ("l3worker:prefix_cache_hits_total", "l3worker:prefix_cache_queries_total")
    if queries not in before or queries not in after or after[queries] == before[queries]:
        return None
    return (after[hits] - before[hits]) / (after[queries] - before[queries])


# -- offline comparison --------------------------------------------------------------------------------
def offline_tpot(args, samples: list[SampleRequest]) -> dict:
    """The same prompts through DistributedWorker.generate, same batch size: per-request TPOT p50."""
    from l3worker import DistributedWorker, SamplingParams

    with DistributedWorker(args.model_dir, max_batch_size=args.max_num_seqs, max_seq_len=args.max_model_len,
                           page_size=args.block_size, cpu_layout=args.cpu_layout, dtype=args.dtype) as w:
        w.generate(samples[0].prompt[:8], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up, as the served run has
        cpu0 = _own_cpu_s()
        t0 = time.perf_counter()
        outs = w.generate([s.prompt for s in samples],
                          [SamplingParams(temperature=0.0, max_new_tokens=s.expected_output_len, ignore_eos=True) for s in samples])
        wall = time.perf_counter() - t0
        cpu = _own_cpu_s() - cpu0
        steps = w.step_records()
    tpot = [o.metrics.tpot_s for o in outs if len(o.token_ids) > 1]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tpot_p50_ms": float(np.median(tpot)) * 1e3, "tpot_mean_ms": float(np.mean(tpot)) * 1e3,
            "wall_s": wall, "output_throughput_tok_per_s": tokens / wall,
            "parent_cpu_us_per_token": cpu / tokens * 1e6, "steps": steps}


def _own_cpu_s() -> float:
    """This process's CPU time (all its threads, not its children)."""
    t = os.times()
    return t.user + t.system


# -- launching a server -------------------------------------------------------------------------------
class Launched:
    def __init__(self, args):
        cmd = [sys.executable, "-m", "l3worker", "serve", *([args.model_dir] if args.model_dir else []),
               "--port", "0", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               *(["--block-size", str(args.block_size)] if args.block_size else []), "--cpu-layout", args.cpu_layout,
               "--dtype", args.dtype,
               "--disable-log-requests",
               *shlex.split(args.serve_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.step_trace:
            Path(args.step_trace).mkdir(parents=True, exist_ok=True)
            env[STEP_TRACE_ENV] = str(Path(args.step_trace) / "served_steps.json")
        print("launching:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        self.url = self.model = None
        found = threading.Event()

        def watch() -> None:
            for line in self.proc.stdout:
                if (m := READY.search(line)) and not found.is_set():
                    self.url, self.model = m.groups()
                    found.set()
            found.set()

        threading.Thread(target=watch, daemon=True).start()
        if not found.wait(600) or self.url is None:
            self.stop()
            raise SystemExit("l3worker serve did not become ready")

    def idle_cpu(self, seconds: float) -> dict:
        import psutil

        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

        def used() -> list[float]:
            return [sum(p.cpu_times()[:2]) for p in procs]

        time.sleep(1.0)  # past the start-up
        before = used()
        time.sleep(seconds)
        spent = [b - a for a, b in zip(before, used())]
        return {"seconds": seconds, "server_cpu_s": spent[0], "children_cpu_s": sum(spent[1:]),
                "cpu_percent": 100 * sum(spent) / seconds}

    def cpu_s(self) -> dict | None:
        """CPU seconds of the API server processes (`l3worker serve` and any --api-server-count
        others), of the engine-core process and of the chip-children; None without psutil."""
        try:
            import psutil
        except ImportError:
            return None
        main = psutil.Process(self.proc.pid)
        spent = {"api_servers": sum(main.cpu_times()[:2]), "engine_core": 0.0, "chip_children": 0.0}
        for proc in main.children(recursive=True):
            try:
                cmdline, cpu = proc.cmdline(), sum(proc.cpu_times()[:2])
            except psutil.NoSuchProcess:
                continue
            if "l3worker.serving.api_server" in cmdline:
                spent["api_servers"] += cpu
            elif "l3worker.serving.engine_core" in cmdline:
                spent["engine_core"] += cpu
            elif "chip_child" in cmdline:
                spent["chip_children"] += cpu
        return spent

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_serve_args(p)
    p.set_defaults(num_prompts=200, random_input_len=128, random_output_len=128, temperature=0.0)
    p.add_argument("--result-file", default=None, help="write every repeat, the offline runs and ratios as JSON here")
    g = p.add_argument_group("launching l3worker serve / the offline comparison")
    g.add_argument("--launch", action="store_true", help="start `l3worker serve` on a free port, stop it after")
    g.add_argument("--offline", action="store_true",
                   help="first run the same prompts through DistributedWorker.generate (TPOT p50)")
    g.add_argument("--model-dir", default=None, help="checkpoint (default: the built-in tiny model)")
    g.add_argument("--bench-decode-model", choices=("overhead", "compute"), default=None,
                   help="serve scripts/bench_decode.py's random checkpoint of that workload (written once to "
                        "$L3WORKER_CACHE or ~/.cache/l3worker; needs transformers; no tokenizer: id prompts only)")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page; omitted: 16 on the CPU, 128 on NPUs and GPUs")
    g.add_argument("--dtype", default="auto", help="the model dtype of both the served and the offline worker")
    g.add_argument("--cpu-layout", choices=("auto", "every_core", "spare_core"), default="auto",
                   help="on a cpu, the layout of both the served and the offline worker: a fixed one compares "
                        "like with like (auto may choose differently for each)")
    g.add_argument("--serve-args", default="", help="more `l3worker serve` flags, one string")
    g.add_argument("--step-trace", default=None, metavar="DIR",
                   help="with --launch: the served engine's step records (and the offline run's) go to DIR, and "
                        "a breakdown of both is printed (scripts/step_breakdown.py)")
    g.add_argument("--repeats", type=int, default=1, help="runs of the load (each after its offline run)")
    g.add_argument("--idle-cpu-s", type=float, default=0.0,
                   help="with --launch: first measure the idle server's CPU time (parent and children) over "
                        "this many seconds (needs psutil)")
    args = p.parse_args(argv)
    try:
        check_serve(args)
    except ValueError as e:
        p.error(str(e))
    if len(args.request_rate) > 1:
        p.error("one --request-rate per run (`l3worker bench serve --request-rate A B ...` sweeps)")
    return args


def print_report(args: argparse.Namespace, result: dict) -> None:
    s = result["served"]
    print("\n".join(report_lines(s, parse_percentile_metrics(args.percentile_metrics),
                                 parse_percentiles(args.metric_percentiles))))
    for e in result["errors"]:
        print(f"  error: {e}")
    if s.get("prefix_cache_hit_rate") is not None:
        print(f"{'prefix cache hit rate (prompt tokens)':<40} {s['prefix_cache_hit_rate']:.3f}")
    if s.get("server_cpu_us_per_token"):
        print(f"{'API server CPU per output token (us)':<40} {s['server_cpu_us_per_token']:.1f}")
    for key, label in (("engine_core", "engine core"), ("chip_children", "chip-children"),
                       ("client", "load client (this process)")):
        if s.get(f"{key}_cpu_us_per_token"):
            print(f"{label + ' CPU per output token (us)':<40} {s[f'{key}_cpu_us_per_token']:.1f}")
    if result.get("idle"):
        i = result["idle"]
        print(f"{'idle server CPU':<40} {i['server_cpu_s']:.3f} s server + {i['children_cpu_s']:.3f} s children "
              f"over {i['seconds']:g} s ({i['cpu_percent']:.2f}%)")
    if result.get("server_after"):
        print(f"{'server gauges after the run':<40} {result['server_after']}")
    if result.get("offline"):
        o = result["offline"]
        print(f"{'offline TPOT (ms) mean / p50':<40} {o['tpot_mean_ms']:.2f} / {o['tpot_p50_ms']:.2f}")
        print(f"{'offline output throughput (tok/s)':<40} {o['output_throughput_tok_per_s']:.1f}")
        print(f"{'offline parent CPU per token (us)':<40} {o['parent_cpu_us_per_token']:.1f}")
    if "ratios" in result:
        r = result["ratios"]
        each = lambda k: " ".join(f"{x:.3f}" for x in r[k])  # noqa: E731
        if r["itl_p50_over_offline_tpot_p50_median"] is not None:
            print(f"{'served ITL p50 / offline TPOT p50':<40} {r['itl_p50_over_offline_tpot_p50_median']:.3f}"
                  f"  (repeats: {each('itl_p50_over_offline_tpot_p50')})")
        print(f"{'served TPOT p50 / offline TPOT p50':<40} {r['tpot_p50_over_offline_tpot_p50_median']:.3f}"
              f"  (repeats: {each('tpot_p50_over_offline_tpot_p50')})")


def bench_decode_checkpoint(workload: str) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_decode import WORKLOADS, write_checkpoint

    cache = Path(os.environ.get("L3WORKER_CACHE") or Path.home() / ".cache" / "l3worker")
    path = cache / f"bench-decode-{workload}"
    if not (path / "model.safetensors").is_file():
        write_checkpoint(path, WORKLOADS[workload])
    return str(path)


def _jsonable(v):
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return "inf" if v == math.inf else v


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bench_decode_model:
        args.model_dir = bench_decode_checkpoint(args.bench_decode_model)
    result: dict = {"config": {k: _jsonable(v) for k, v in vars(args).items() if k != "api_key"}, "repeats": []}
    server = Launched(args) if args.launch else None
    try:
        base_url = server.url if server else base_url_of(args)
        model = args.model or (server.model if server else first_model(base_url, args.api_key))
        samples = serve_samples(args, base_url, model)
        if server is not None and args.idle_cpu_s > 0:
            result["idle"] = server.idle_cpu(args.idle_cpu_s)
        for _ in range(args.repeats):  # offline and served alternate, so drifting machine load hits both
            run = {"offline": offline_tpot(args, samples)} if args.offline else {}
            cpu0 = server.cpu_s() if server else None
            counters0 = scrape(base_url)
            client0 = _own_cpu_s()
            run["served"], outputs = serve_once(args, base_url, model, samples, args.request_rate[0])
            tokens = max(run["served"]["total_output_tokens"], 1)
            run["served"]["client_cpu_us_per_token"] = (_own_cpu_s() - client0) / tokens * 1e6
            run["served"]["prefix_cache_hit_rate"] = prefix_hit_rate(counters0, scrape(base_url))
            if cpu0 is not None:  # includes the test request's few tokens
                cpu1 = server.cpu_s()
                for name, key in (("api_servers", "server"), ("engine_core", "engine_core"),
                                  ("chip_children", "chip_children")):
                    run["served"][f"{key}_cpu_us_per_token"] = (cpu1[name] - cpu0[name]) / tokens * 1e6
            result["repeats"].append(run)
        result["server_after"] = scrape(base_url)
        result["per_request"] = [asdict(o) | {"tpot": o.tpot} for o in outputs]  # the last repeat's
        result["errors"] = sorted({o.error for o in outputs if not o.success})[:5]
    finally:
        if server is not None:
            result["server_exit_code"] = server.stop()
    last = result["repeats"][-1]
    result["served"], result["offline"] = last["served"], last.get("offline")
    if args.offline:
        # A served ITL median of 0 (chunks that reached the client together) makes no ITL ratio.
        itl = [r["served"]["median_itl_ms"] / r["offline"]["tpot_p50_ms"] for r in result["repeats"]
               if r["served"]["median_itl_ms"]]
        tpot = [r["served"]["median_tpot_ms"] / r["offline"]["tpot_p50_ms"] for r in result["repeats"]]
        result["ratios"] = {"itl_p50_over_offline_tpot_p50": itl, "tpot_p50_over_offline_tpot_p50": tpot,
                            "itl_p50_over_offline_tpot_p50_median": float(np.median(itl)) if itl else None,
                            "tpot_p50_over_offline_tpot_p50_median": float(np.median(tpot))}
    print_report(args, result)
    if args.step_trace and server is not None:
        named = {"served": json.loads((Path(args.step_trace) / "served_steps.json").read_text())}
        if result["offline"]:
            named["offline"] = result["offline"]["steps"]
        print_breakdowns(named)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0 if all(r["served"]["failed"] == 0 for r in result["repeats"]) else 1


if __name__ == "__main__":
    sys.exit(main())
