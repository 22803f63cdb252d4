#!/usr/bin/env python
"""CPU time and context switches per output token, for each thread of a running server's process
tree, over one run of a load client:

    python scripts/served_threads.py PID -- vllm bench serve --backend vllm --base-url http://127.0.0.1:8000 ...

PID is the server's first process (`l3worker serve`'s API server, or `llama-server`); the tree
under it (engine core, chip-child) is found with psutil, and each thread's counters are read from
/proc (psutil has neither thread names nor a thread's context switches), before and after the
client runs. The
output tokens come from the client's "Total generated tokens:" line (vLLM's and l3worker's bench
serve print it), or --tokens. Per thread: user+system CPU and system CPU in µs per token, and the
switches per token: involuntary (the thread was preempted) and voluntary (it slept). On a machine
whose cores the child's threads fill, every wake-up of another thread preempts one of them.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import psutil

TOKENS_LINE = re.compile(r"Total generated tokens:\s*(\d+)")


@dataclass(frozen=True)
class ThreadCounts:
    name: str
    cpu_ticks: int  # user + system, in clock ticks
    sys_ticks: int
    involuntary: int
    voluntary: int


def tree(root: int) -> list[int]:
    """root and every process under it (psutil walks the parent links); empty once root is gone."""
    try:
        return [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def thread_counts(pid: int, tid: int) -> ThreadCounts | None:
    """One thread's counters; None for a thread that ended meanwhile."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            stat = f.read()
        with open(f"{base}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except OSError:
        return None
    close = stat.rindex(")")  # the name may hold parentheses; the fields after it cannot
    name, fields = stat[stat.index("(") + 1:close], stat[close + 2:].split()  # fields from 3 (state) on
    utime, stime = int(fields[11]), int(fields[12])
    return ThreadCounts(name, utime + stime, stime, int(status["nonvoluntary_ctxt_switches"]),
                        int(status["voluntary_ctxt_switches"]))


def snapshot(root: int) -> dict[tuple[int, int], ThreadCounts]:
    """(pid, tid) -> counters, for every thread of the tree under root."""
    snap = {}
    for pid in tree(root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            if (counts := thread_counts(pid, tid)) is not None:
                snap[(pid, tid)] = counts
    return snap


def per_token(before: dict, after: dict, tokens: int) -> list[tuple[int, int, str, float, float, float, float]]:
    """(pid, tid, name, cpu µs, sys µs, involuntary, voluntary) per token for each thread alive at
    the end, busiest first; a thread that started during the run counts from zero."""
    us_per_tick = 1e6 / os.sysconf("SC_CLK_TCK")
    rows = []
    for key, b in after.items():
        a = before.get(key, ThreadCounts(b.name, 0, 0, 0, 0))
        rows.append((*key, b.name, (b.cpu_ticks - a.cpu_ticks) * us_per_tick / tokens,
                     (b.sys_ticks - a.sys_ticks) * us_per_tick / tokens,
                     (b.involuntary - a.involuntary) / tokens, (b.voluntary - a.voluntary) / tokens))
    return sorted(rows, key=lambda r: -r[3])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: served_threads.py PID [--tokens N] -- CLIENT COMMAND...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--tokens", type=int, help="output tokens of the run (else read from the client's output)")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        parser.error("no client command after --")
    if not os.path.exists(f"/proc/{args.pid}"):
        parser.error(f"pid {args.pid}: no such process")
    before = snapshot(args.pid)
    done = subprocess.run(command, capture_output=True, text=True)
    after = snapshot(args.pid)
    sys.stderr.write(done.stderr[-2000:] if done.returncode else "")
    tokens = args.tokens
    if tokens is None:
        match = TOKENS_LINE.search(done.stdout)
        if match is None:
            print(f"the client (rc {done.returncode}) printed no 'Total generated tokens:' line; give --tokens",
                  file=sys.stderr)
            return 1
        tokens = int(match.group(1))
    if tokens <= 0:
        print(f"tokens must be > 0, got {tokens}", file=sys.stderr)
        return 1
    print(f"{tokens} output tokens; per token:")
    print(f"{'pid/tid':<16} {'thread':<16} {'cpu µs':>8} {'sys µs':>8} {'preempted':>10} {'slept':>8}")
    for pid, tid, name, cpu, sys_us, inv, vol in per_token(before, after, tokens):
        print(f"{f'{pid}/{tid}':<16} {name:<16} {cpu:8.1f} {sys_us:8.1f} {inv:10.2f} {vol:8.2f}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
