"""What the multi-node tests share: a node (a tensor-parallel follower or a data-parallel headless
node, `l3worker serve --headless`) started as its own process tree on the loopback, and the
stopping of every one a test started."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from l3worker.distributed.follower import follower_command
from l3worker.distributed.nodes import NodeLayout

ROOT = Path(__file__).resolve().parent.parent


def start_node(cmd: list[str], tmpdir: Path, log_name: str) -> subprocess.Popen:
    """`cmd` in a process tree of its own with TMPDIR=tmpdir; its output goes to tmpdir/log_name."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    with open(tmpdir / log_name, "ab") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def kill_nodes(started: list[subprocess.Popen]) -> None:
    """Every node still running, with its whole process tree (a test's teardown)."""
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def start_follower(model_dir: str | os.PathLike, master_port: int, *flags: str, tmpdir: Path,
                   tensor_parallel_size: int = 2, nnodes: int = 2, node_rank: int = 1) -> subprocess.Popen:
    """A cpu follower node in a process tree of its own; its output goes to tmpdir/follower-R.log."""
    layout = NodeLayout(tensor_parallel_size, nnodes, node_rank, "127.0.0.1", master_port)
    return start_node(follower_command(str(model_dir), layout, "--device", "cpu", *flags), tmpdir,
                      f"follower-{node_rank}.log")
