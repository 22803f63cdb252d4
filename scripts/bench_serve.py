"""Serving benchmark, modelled on vLLM's: random token-id prompts sent as streaming /v1/completions
requests to any OpenAI-compatible server, at a Poisson rate (or all at once) and at most
--max-concurrency at a time. Reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99) and
request and token throughput; prints them and writes them as JSON (--result-file).

  # against a running server
  python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20

  # start `l3worker serve` on a free port, run, stop it; --offline first runs the same prompts through
  # DistributedWorker.generate (same model and batch size) and reports served ITL p50 / offline TPOT p50
  python scripts/bench_serve.py --launch --offline --max-num-seqs 16 --max-concurrency 16 --num-prompts 64

Every request sets ignore_eos and max_tokens, so each produces exactly its output length (as vLLM's
random dataset does). Timings are the client's: run the client and server on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"ready at (http://\S+) serving (\S+)")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# -- workload ----------------------------------------------------------------------------------------
def make_requests(args) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = np.random.default_rng(args.seed)

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.integers(lo, hi + 1, args.num_prompts)

    ins, outs = lengths(args.input_len), lengths(args.output_len)
    low, high = args.token_range
    return [(rng.integers(low, high, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


# -- client ------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_len=len(prompt))
    t0 = time.perf_counter()
    last = t0
    events = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                # Only the rare chunks are parsed: the client shares the machine with the server.
                if data.startswith('{"error"'):
                    res.error = str(json.loads(data)["error"])
                    return res
                if '"choices":[{' in data:
                    if events == 0:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    events += 1
                if '"usage":{' in data:
                    res.output_tokens = json.loads(data)["usage"]["completion_tokens"]
        res.e2e_s = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or events
        res.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(args, base_url: str, model: str, requests) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + args.endpoint
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    concurrency = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    rng = np.random.default_rng(args.seed + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        warm = await one_request(client, url, model, requests[0][0][:8], 4, headers)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt, max_tokens):
            async with gate:
                return await one_request(client, url, model, prompt, max_tokens, headers)

        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
        a = np.asarray(values) * 1e3
        return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
                "p99_ms": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput_per_s": len(ok) / duration_s,
        "output_throughput_tok_per_s": out_tokens / duration_s,
        "total_token_throughput_tok_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration_s,
        "ttft": stats([r.ttft_s for r in ok]),
        "tpot": stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl": stats([x for r in ok for x in r.itl_s]),
        "e2e": stats([r.e2e_s for r in ok]),
    }


def scrape(base_url: str, api_key: str | None) -> dict:
    """The server's l3worker gauges after the run, where it exports them."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    names = ("l3worker:num_requests_running", "l3worker:num_requests_waiting", "l3worker:kv_cache_usage_perc")
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            found[parts[0]] = float(parts[1])
    return found


# -- offline comparison --------------------------------------------------------------------------------
def offline_tpot(args, requests) -> dict:
    """The same prompts through DistributedWorker.generate, same batch size: per-request TPOT p50."""
    from l3worker import DistributedWorker, SamplingParams

    with DistributedWorker(args.model_dir, max_batch_size=args.max_num_seqs, max_seq_len=args.max_model_len,
                           page_size=args.block_size) as w:
        w.generate(requests[0][0][:8], SamplingParams(max_new_tokens=4))  # warm-up, as the served run has
        cpu0 = _own_cpu_s()
        t0 = time.perf_counter()
        outs = w.generate([p for p, _ in requests],
                          [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m in requests])
        wall = time.perf_counter() - t0
        cpu = _own_cpu_s() - cpu0
    tpot = [o.metrics.tpot_s for o in outs if len(o.token_ids) > 1]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tpot_p50_ms": float(np.median(tpot)) * 1e3, "tpot_mean_ms": float(np.mean(tpot)) * 1e3,
            "wall_s": wall, "output_throughput_tok_per_s": tokens / wall,
            "parent_cpu_us_per_token": cpu / tokens * 1e6}


def _own_cpu_s() -> float:
    """This process's CPU time (all its threads, not its children)."""
    t = os.times()
    return t.user + t.system


# -- launching a server -------------------------------------------------------------------------------
class Launched:
    def __init__(self, args):
        cmd = [sys.executable, "-m", "l3worker", "serve", *([args.model_dir] if args.model_dir else []),
               "--port", "0", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--block-size", str(args.block_size), "--disable-log-requests", *shlex.split(args.serve_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
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

    def cpu_s(self) -> float | None:
        """The server process's CPU time (not its chip-children's), where psutil is installed."""
        try:
            import psutil
        except ImportError:
            return None
        return sum(psutil.Process(self.proc.pid).cpu_times()[:2])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (ignored with --launch)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("L3WORKER_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    p.add_argument("--token-range", type=int, nargs=2, default=(0, 256), metavar=("LOW", "HIGH"),
                   help="prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
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
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--serve-args", default="", help="more `l3worker serve` flags, one string")
    g.add_argument("--repeats", type=int, default=1, help="runs of the load (each after its offline run)")
    g.add_argument("--idle-cpu-s", type=float, default=0.0,
                   help="with --launch: first measure the idle server's CPU time (parent and children) over "
                        "this many seconds (needs psutil)")
    return p.parse_args(argv)


def print_report(result: dict) -> None:
    s = result["served"]
    print(f"{'completed / failed':<36}{s['completed']} / {s['failed']}")
    for e in s["errors"]:
        print(f"  error: {e}")
    print(f"{'duration (s)':<36}{s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<36}{s['request_throughput_per_s']:.2f}")
    print(f"{'output token throughput (tok/s)':<36}{s['output_throughput_tok_per_s']:.1f}")
    print(f"{'total token throughput (tok/s)':<36}{s['total_token_throughput_tok_per_s']:.1f}")
    if s.get("server_cpu_us_per_token"):
        print(f"{'server CPU per output token (us)':<36}{s['server_cpu_us_per_token']:.1f}")
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency")):
        v = s[key]
        if v["mean_ms"] is not None:
            print(f"{label + ' (ms) mean / p50 / p99':<36}{v['mean_ms']:.2f} / {v['p50_ms']:.2f} / {v['p99_ms']:.2f}")
    if result.get("idle"):
        i = result["idle"]
        print(f"{'idle server CPU':<36}{i['server_cpu_s']:.3f} s server + {i['children_cpu_s']:.3f} s children "
              f"over {i['seconds']:g} s ({i['cpu_percent']:.2f}%)")
    if result.get("server_after"):
        print(f"{'server gauges after the run':<36}{result['server_after']}")
    if result.get("offline"):
        o = result["offline"]
        print(f"{'offline TPOT (ms) mean / p50':<36}{o['tpot_mean_ms']:.2f} / {o['tpot_p50_ms']:.2f}")
        print(f"{'offline output throughput (tok/s)':<36}{o['output_throughput_tok_per_s']:.1f}")
        print(f"{'offline parent CPU per token (us)':<36}{o['parent_cpu_us_per_token']:.1f}")
    if "ratios" in result:
        r = result["ratios"]
        each = lambda k: " ".join(f"{x:.3f}" for x in r[k])  # noqa: E731
        print(f"{'served ITL p50 / offline TPOT p50':<36}{r['itl_p50_over_offline_tpot_p50_median']:.3f}"
              f"  (repeats: {each('itl_p50_over_offline_tpot_p50')})")
        print(f"{'served TPOT p50 / offline TPOT p50':<36}{r['tpot_p50_over_offline_tpot_p50_median']:.3f}"
              f"  (repeats: {each('tpot_p50_over_offline_tpot_p50')})")


def bench_decode_checkpoint(workload: str) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_decode import WORKLOADS, write_checkpoint

    cache = Path(os.environ.get("L3WORKER_CACHE") or Path.home() / ".cache" / "l3worker")
    path = cache / f"bench-decode-{workload}"
    if not (path / "model.safetensors").is_file():
        write_checkpoint(path, WORKLOADS[workload])
    return str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bench_decode_model:
        args.model_dir = bench_decode_checkpoint(args.bench_decode_model)
    requests = make_requests(args)
    result: dict = {"config": {k: (v if v != math.inf else "inf") for k, v in vars(args).items()
                               if k != "api_key"}, "repeats": []}
    server = Launched(args) if args.launch else None
    try:
        base_url = server.url if server else args.base_url
        model = args.model or (server.model if server else None)
        if model is None:
            headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if server is not None and args.idle_cpu_s > 0:
            result["idle"] = server.idle_cpu(args.idle_cpu_s)
        for _ in range(args.repeats):  # offline and served alternate, so drifting machine load hits both
            run = {"offline": offline_tpot(args, requests)} if args.offline else {}
            cpu0 = server.cpu_s() if server else None
            results, duration = asyncio.run(run_load(args, base_url, model, requests))
            run["served"] = summarize(results, duration)
            if cpu0 is not None:  # includes the warm-up request's few tokens
                run["served"]["server_cpu_us_per_token"] = \
                    (server.cpu_s() - cpu0) / max(run["served"]["total_output_tokens"], 1) * 1e6
            result["repeats"].append(run)
        result["server_after"] = scrape(base_url, args.api_key)
        result["per_request"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in results]  # the last repeat's
    finally:
        if server is not None:
            result["server_exit_code"] = server.stop()
    last = result["repeats"][-1]
    result["served"], result["offline"] = last["served"], last.get("offline")
    if args.offline and all(r["served"]["itl"]["p50_ms"] for r in result["repeats"]):
        itl = [r["served"]["itl"]["p50_ms"] / r["offline"]["tpot_p50_ms"] for r in result["repeats"]]
        tpot = [r["served"]["tpot"]["p50_ms"] / r["offline"]["tpot_p50_ms"] for r in result["repeats"]]
        result["ratios"] = {"itl_p50_over_offline_tpot_p50": itl, "tpot_p50_over_offline_tpot_p50": tpot,
                            "itl_p50_over_offline_tpot_p50_median": float(np.median(itl)),
                            "tpot_p50_over_offline_tpot_p50_median": float(np.median(tpot))}
    print_report(result)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0 if all(r["served"]["failed"] == 0 for r in result["repeats"]) else 1


if __name__ == "__main__":
    sys.exit(main())
