"""What the multi-node tests share: a master port with free ports above it, and a follower node
started as its own process tree (`l3worker serve --headless`) on the loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_ports(count: int) -> int:
    """A port p such that p .. p + count - 1 were free just now (the rendezvous and the followers'
    command ports)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def start_follower(model_dir: str | os.PathLike, master_port: int, *flags: str, tmpdir: Path,
                   tensor_parallel_size: int = 2, nnodes: int = 2, node_rank: int = 1) -> subprocess.Popen:
    """A follower node in a process tree of its own; its output goes to tmpdir/follower-R.log."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    log = open(tmpdir / f"follower-{node_rank}.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "l3worker", "serve", str(model_dir), "--headless", "--device", "cpu",
             "--tensor-parallel-size", str(tensor_parallel_size), "--nnodes", str(nnodes),
             "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port), *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    finally:
        log.close()
