"""Launch to /health 200 of `l3worker serve`: this checkout, alternated with another one (say a
`git worktree` of an earlier revision) for an A/B of a start-up change.

Each round launches every variant once, in turn, and stops it (SIGTERM) once /health says 200.
`--cold` empties the page cache before each launch (root only: /proc/sys/vm/drop_caches), as a
launch after a long idle finds it where the kernel pages out untouched memory; without it the
files stay cached from the round before. Prints every launch and the medians, and the ratio of
each variant's median to this checkout's.

    python scripts/bench_launch.py CKPT [--rounds 5] [--cold] [--baseline ../l3worker-old] \\
        [--flags "--dtype bfloat16 --max-num-seqs 16 --max-model-len 512"]
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 600.0  # a launch that takes longer has failed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def launch_s(root: Path, ckpt: str, flags: list[str], cold: bool) -> float:
    """Seconds from the command's start to /health 200; the server is stopped after."""
    port = free_port()
    if cold:
        drop_page_cache()
    env = dict(os.environ, PYTHONPATH=str(root))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "l3worker", "serve", ckpt, "--port", str(port), *flags],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"{root}: l3worker serve exited with {proc.returncode} before /health said 200")
            if time.perf_counter() - t0 > BOUND_S:
                raise RuntimeError(f"{root}: no /health 200 within {BOUND_S:g} s")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="empty the page cache before each launch (root)")
    parser.add_argument("--baseline", action="append", default=[], metavar="CHECKOUT",
                        help="another checkout to alternate with (repeatable)")
    parser.add_argument("--flags", default="--dtype bfloat16 --max-num-seqs 16 --max-model-len 512",
                        help="l3worker serve's flags, as one string")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    variants = [ROOT, *(Path(b).resolve() for b in args.baseline)]
    flags = shlex.split(args.flags)
    times: dict[Path, list[float]] = {v: [] for v in variants}
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {os.cpu_count()} cores, "
          f"{'cold' if args.cold else 'warm'} page cache, flags: {args.flags}")
    for r in range(args.rounds):
        for v in variants:
            times[v].append(launch_s(v, args.ckpt, flags, args.cold))
            print(f"round {r + 1}: {v}: {times[v][-1]:.2f} s", flush=True)
    base = statistics.median(times[ROOT])
    for v in variants:
        median = statistics.median(times[v])
        print(f"median {median:.2f} s ({median / base:.2f}x this checkout's): {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
