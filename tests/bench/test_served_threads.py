"""scripts/served_threads.py: CPU and context switches per output token, per thread of a server's
process tree, over one run of a load client."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "served_threads.py"
sys.path.insert(0, str(SCRIPT.parent))

from served_threads import ThreadCounts, per_token, snapshot, tree  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")

# A stand-in server: a process that starts a child which burns CPU until killed.
SERVER = ("import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(600)")


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER])
    try:
        deadline = time.monotonic() + 30
        while len(tree(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield proc
    finally:
        for pid in reversed(tree(proc.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()


def test_the_tree_holds_the_servers_child_and_each_thread_is_counted(server):
    pids = tree(server.pid)
    assert pids[0] == server.pid and len(pids) == 2
    snap = snapshot(server.pid)
    assert {pid for pid, _ in snap} == set(pids)
    assert all(c.cpu_ticks >= c.sys_ticks >= 0 and c.voluntary >= 0 for c in snap.values())


def test_a_run_gives_the_busy_childs_cpu_per_token(server):
    client = [sys.executable, "-c", "import time; time.sleep(0.5); print('Total generated tokens: 50')"]
    out = subprocess.run([sys.executable, str(SCRIPT), str(server.pid), "--", *client],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "50 output tokens; per token:"
    busiest = lines[2].split()
    child = tree(server.pid)[1]
    assert busiest[0] == f"{child}/{child}"
    # 0.5 s of one core over 50 tokens is about 10 ms a token; the sleeping parent far less
    assert float(busiest[2]) > 1000
    assert float(lines[-1].split()[2]) < float(busiest[2])


def test_figures_are_per_token_and_a_new_thread_counts_from_zero():
    before = {(1, 1): ThreadCounts("a", 10, 2, 4, 8)}
    after = {(1, 1): ThreadCounts("a", 30, 6, 8, 18), (1, 2): ThreadCounts("b", 5, 0, 2, 2)}
    rows = per_token(before, after, tokens=2)
    tick_us = 1e6 / __import__("os").sysconf("SC_CLK_TCK")
    assert rows[0] == (1, 1, "a", 10 * tick_us, 2 * tick_us, 2.0, 5.0)
    assert rows[1] == (1, 2, "b", 2.5 * tick_us, 0.0, 1.0, 1.0)


def test_bad_calls_are_refused_by_name(server):
    def run(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)

    no_sep = run(str(server.pid), "true")
    assert no_sep.returncode == 2 and "--" in no_sep.stderr
    gone = run("999999999", "--", "true")
    assert gone.returncode == 2 and "no such process" in gone.stderr
    silent = run(str(server.pid), "--", "true")
    assert silent.returncode == 1 and "Total generated tokens" in silent.stderr
    given = run(str(server.pid), "--tokens", "0", "--", "true")
    assert given.returncode == 1 and "tokens must be > 0" in given.stderr
