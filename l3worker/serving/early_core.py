"""The engine-core process, started first thing by `l3worker serve`, before API server 0 imports
the engine and checks the arguments: the core's imports (and, on the cpu, its early chip-child's,
l3worker/worker/early_child.py) run beside this process's instead of after them. Its config follows
on stdin once the arguments are known good; discard() ends it and its early child at once (they
hold nothing yet, and share a process group). Light on purpose: nothing here imports torch.
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from l3worker.worker.early_child import EarlyChild

CORE_MODULE = "l3worker.serving.engine_core"
EARLY_CHILD_FLAG = "--early-child"  # `python -m l3worker.serving.engine_core --early-child DEVICE`


class EarlyCore:
    def __init__(self, device: str) -> None:
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", CORE_MODULE, EARLY_CHILD_FLAG, device], stdin=subprocess.PIPE,
            start_new_session=True)

    @classmethod
    def start(cls, args: argparse.Namespace) -> "EarlyCore | None":
        """One, where this command runs exactly one engine core of its own (not --headless, not
        --inline-engine, no data parallelism); None where it cannot start (the launch then
        starts the core as usual)."""
        if args.headless or args.inline_engine or args.data_parallel_size != 1:
            return None
        try:
            return cls(args.device)
        except OSError as exc:
            print(f"l3worker serve: no early engine core ({exc}); the launch starts one", file=sys.stderr, flush=True)
            return None

    def take(self, config_json: str) -> subprocess.Popen:
        """Gives the core its config; from here on it is the launch's to stop."""
        proc, self.proc = self.proc, None
        proc.stdin.write(config_json.encode())
        proc.stdin.close()
        return proc

    def discard(self) -> None:
        """The arguments were refused, or the start failed before the core had its config."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stdin.close()
        proc.wait()


def start_early_child(argv: list[str]) -> "EarlyChild | None":
    """The engine core's first act, given `--early-child DEVICE`: its early chip-child. Until the
    core takes its signals over, a SIGTERM exits it in order, and any exit ends the child too."""
    if argv[1:2] != [EARLY_CHILD_FLAG]:
        return None
    from l3worker.worker.early_child import EarlyChild

    early = EarlyChild.start(argv[2])
    if early is not None:
        atexit.register(early.discard)  # a no-op once a launch took it
        signal.signal(signal.SIGTERM, _exit_0)
    return early


def _exit_0(signum, frame) -> None:
    sys.exit(0)
