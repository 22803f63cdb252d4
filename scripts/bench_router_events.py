"""Does the built-in cache-aware router route better when it follows the engines' KV events?

`l3worker serve --data-parallel-size 2 --api-server-count 2` with the built-in model, once with
`--kv-events-config` (each API server's router follows what both engines store and evict) and once
without (each router guesses from the requests it sent itself, and sees about half of them). The
workload: 12 shared prefixes of 4 pages, each requested 4 times in a shuffled order, 4 requests in
flight, each on a new connection (so the kernel spreads them over the API servers). Prints the
prefix-cache hit rate (prompt tokens the engines' caches supplied over those looked up) of each,
per run, with the two alternated, and their medians.

    PYTHONPATH=. python scripts/bench_router_events.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import Launched, prefix_hit_rate, scrape  # noqa: E402

BLOCK, PREFIX_PAGES, PREFIXES, VISITS = 16, 4, 12, 4


def free_port_pair() -> int:
    """A port p with p + 1 free too (the second rank publishes there)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise SystemExit("no free pair of ports")


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 200) for _ in range(PREFIX_PAGES * BLOCK)] for _ in range(PREFIXES)]
    order = [k for k in range(PREFIXES) for _ in range(VISITS)]
    rng.shuffle(order)
    return [prefixes[k] + [200 + n % 50, 2, 3, 4] for n, k in enumerate(order)]


def one_run(events: bool, seed: int) -> float:
    serve_args = "--data-parallel-size 2 --api-server-count 2 --num-gpu-blocks-override 60"
    if events:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port_pair()}"}
        serve_args += f" --kv-events-config '{json.dumps(config)}'"
    server = Launched(SimpleNamespace(model_dir=None, max_num_seqs=4, max_model_len=128, block_size=BLOCK,
                                      cpu_layout="auto", serve_args=serve_args, api_key=None))
    try:
        before = scrape(server.url)

        def send(prompt: list[int]) -> None:
            with httpx.Client(base_url=server.url, timeout=120, headers={"connection": "close"}) as client:
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
                r.raise_for_status()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, workload(seed)))
        return prefix_hit_rate(before, scrape(server.url))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {"guess": [], "events": []}
    for r in range(args.repeats):
        for name in ("guess", "events"):
            rates[name].append(one_run(name == "events", seed=r))
            print(f"run {r + 1} {name}: hit rate {rates[name][-1]:.3f}", flush=True)
    guess, events = (statistics.median(rates[k]) for k in ("guess", "events"))
    best = PREFIX_PAGES * BLOCK * (VISITS - 1) / (VISITS * (PREFIX_PAGES * BLOCK + 4))
    print(f"prefix-cache hit rate, median of {args.repeats}: router guessing {guess:.3f}, following KV events "
          f"{events:.3f} (at most {best:.3f}: each prefix computed once)")


if __name__ == "__main__":
    main()
