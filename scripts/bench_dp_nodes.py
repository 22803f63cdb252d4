"""Data-parallel engines across nodes: how soon the head notices a lost headless node.

A head (`l3worker serve --data-parallel-size 2 --data-parallel-size-local 1`, the built-in model
on the cpu, round_robin routing) and a headless node (rank 1) on the loopback, each a process
tree of its own. Per run: one request to engine 0, then a long stream that lands on engine 1;
once it streams, the node is killed (SIGKILL: its connections close) or frozen (SIGSTOP: its
connections stay open, only the heartbeats stop). Printed: the seconds from the signal to the
stream's error event and to /health answering 503.

    PYTHONPATH=. python scripts/bench_dp_nodes.py [--repeats 3] [--signal SIGKILL|SIGSTOP]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

READY = re.compile(r"ready at (http://\S+) ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(sig: signal.Signals) -> tuple[float, float]:
    port, tmp = _free_port(), tempfile.mkdtemp(prefix="bench-dp-")
    flags = ["--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "4096", "--block-size", "16",
             "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port)]
    cmd = [sys.executable, "-m", "l3worker", "serve"]
    env = dict(os.environ, TMPDIR=tmp)
    head = subprocess.Popen([*cmd, "--port", "0", *flags, "--data-parallel-routing", "round_robin"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    node = subprocess.Popen([*cmd, "--headless", *flags, "--data-parallel-start-rank", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = next(m.group(1) for line in head.stdout if (m := READY.search(line)))
        http = httpx.Client(base_url=url, timeout=60)
        http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})  # engine 0: the next is 1's
        seen: dict[str, float] = {}

        def stream() -> None:
            body = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
                for chunk in r.iter_raw():
                    seen.setdefault("first", time.monotonic())
                    if b'"error"' in chunk:
                        seen["error"] = time.monotonic()

        reader = threading.Thread(target=stream)
        reader.start()
        while "first" not in seen and reader.is_alive():
            time.sleep(0.01)
        time.sleep(0.3)
        start = time.monotonic()
        os.killpg(node.pid, sig)
        while http.get("/health").status_code == 200:
            time.sleep(0.01)
        health = time.monotonic() - start
        reader.join(60)
        return seen["error"] - start, health
    finally:
        for proc in (node, head):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--signal", default="SIGKILL", choices=("SIGKILL", "SIGSTOP"))
    args = parser.parse_args()
    for k in range(args.repeats):
        error, health = one_run(signal.Signals[args.signal])
        print(f"run {k}: {args.signal} -> stream error event {error:.3f} s, /health 503 {health:.3f} s", flush=True)


if __name__ == "__main__":
    main()
