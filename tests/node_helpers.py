"""What the multi-node tests share: a node (a tensor-parallel follower or a data-parallel headless
node, `l3worker serve --headless`) started as its own process tree on the loopback, and the
stopping of every one a test started."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from fault_helpers import wait_for
from l3worker.distributed.follower import follower_command
from l3worker.distributed.nodes import NodeLayout

ROOT = Path(__file__).resolve().parent.parent


def private_tmpdir(prefix: str) -> Path:
    """A short TMPDIR under /tmp for a process tree a test starts: socket paths under it fit a Unix
    socket address whatever the length of pytest's own directories (longer under pytest-xdist),
    so the tree's socket directories land there, where the test checks them. The caller removes it."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_node(cmd: list[str], log_dir: Path, log_name: str) -> subprocess.Popen:
    """`cmd` in a process tree of its own with a private TMPDIR (`proc.tmpdir`, removed by
    kill_nodes); its output goes to log_dir/log_name."""
    log_dir.mkdir(parents=True, exist_ok=True)
    tmpdir = private_tmpdir("node-")
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    with open(log_dir / log_name, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    proc.tmpdir = tmpdir
    proc.log_path = log_dir / log_name
    return proc


def wait_for_log_line(proc: subprocess.Popen, text: str, timeout_s: float = 120.0) -> None:
    """Waits until the node's log holds `text` (a node logs "waiting for the head" once it has
    imported everything and connects), so that a test's next step does not race its start-up."""
    def logged() -> bool:
        return text in proc.log_path.read_text(errors="replace")

    assert wait_for(lambda: logged() or proc.poll() is not None, timeout_s), \
        f"the node did not log {text!r} within {timeout_s:g}s"
    assert logged(), f"the node exited ({proc.returncode}) before logging {text!r}"


def kill_nodes(started: list[subprocess.Popen]) -> None:
    """Every node still running, with its whole process tree, and their TMPDIRs (a test's teardown)."""
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        shutil.rmtree(proc.tmpdir, ignore_errors=True)


def start_follower(model_dir: str | os.PathLike, master_port: int, *flags: str, log_dir: Path,
                   tensor_parallel_size: int = 2, nnodes: int = 2, node_rank: int = 1) -> subprocess.Popen:
    """A cpu follower node in a process tree of its own; its output goes to log_dir/follower-R.log."""
    layout = NodeLayout(tensor_parallel_size, nnodes, node_rank, "127.0.0.1", master_port)
    return start_node(follower_command(str(model_dir), layout, "--device", "cpu", *flags), log_dir,
                      f"follower-{node_rank}.log")
