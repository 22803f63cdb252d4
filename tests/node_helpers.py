"""What the multi-node tests share: a follower node started as its own process tree
(`l3worker serve --headless`) on the loopback."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from l3worker.follower import follower_command
from l3worker.nodes import NodeLayout

ROOT = Path(__file__).resolve().parent.parent


def start_follower(model_dir: str | os.PathLike, master_port: int, *flags: str, tmpdir: Path,
                   tensor_parallel_size: int = 2, nnodes: int = 2, node_rank: int = 1) -> subprocess.Popen:
    """A cpu follower node in a process tree of its own; its output goes to tmpdir/follower-R.log."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    layout = NodeLayout(tensor_parallel_size, nnodes, node_rank, "127.0.0.1", master_port)
    with open(tmpdir / f"follower-{node_rank}.log", "ab") as log:
        return subprocess.Popen(follower_command(str(model_dir), layout, "--device", "cpu", *flags), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
