"""A cpu chip-child started before its parent knows its spec, so that its imports (torch, about
two seconds) run beside the parent's own instead of after them: `l3worker serve`'s engine core
starts one first thing, then imports, reads its config and builds its worker, whose first launch
hands the waiting child its spec and shared buffers instead of starting a new process.

The child waits on a socket pair (its stdin) for its spec and the buffers' descriptors
(chip_child/spec_handover.py). The pair closing with no spec (the parent chose not to use it, or
died) ends the child at once. Light on purpose: nothing here imports torch.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import chip_child
from chip_child.child_spec import ChildSpec
from chip_child.environment import child_environment
from chip_child.spec_handover import EARLY_FLAG, send_spec


def child_env(cpu: bool) -> dict[str, str]:
    """A chip-child's environment: this one's, the cpu child's OpenMP settings, and the package
    on its path (a child started from a checkout imports the same chip_child)."""
    env = child_environment(dict(os.environ)) if cpu else dict(os.environ)
    package_root = str(Path(chip_child.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def surely_cpu(device: str) -> bool:
    """`device` resolves to the cpu, told without importing torch: `cpu`, or `auto` where no
    accelerator could answer (no torch_npu, no NVIDIA or AMD GPU device files). A wrong guess
    costs only the early child: the launch then starts a child of the resolved kind as usual."""
    if device == "cpu":
        return True
    return device == "auto" and importlib.util.find_spec("torch_npu") is None and \
        not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


class EarlyChild:
    """A started chip-child waiting for its spec: a launch hands it over, or it is discarded. It
    shares its parent's process group (the engine core's own) while it waits, so a core discarded
    before its config arrives takes it along (l3worker/serving/early_core.py); handed its spec, it
    starts a session of its own, as every other chip-child runs in."""

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "chip_child", EARLY_FLAG], stdin=theirs, env=child_env(cpu=True))
        except BaseException:
            self._sock.close()
            raise
        finally:
            theirs.close()

    @classmethod
    def start(cls, device: str) -> "EarlyChild | None":
        """One early cpu child, or None where `device` may not be the cpu or the start failed
        (the launch then starts its child as usual)."""
        if not surely_cpu(device):
            return None
        try:
            return cls()
        except OSError as exc:
            print(f"l3worker: no early chip-child ({exc}); the launch starts one", file=sys.stderr, flush=True)
            return None

    def usable(self, device: str, device_ids: list[int]) -> "EarlyChild | None":
        """This child, where the launch starts one cpu child; else None, this one discarded."""
        from chip_child.device import device_type  # torch: imported by now, where a launch runs

        if len(device_ids) == 1 and device_type(device) == "cpu":
            return self
        self.discard()
        return None

    def hand_over(self, spec: ChildSpec) -> subprocess.Popen:
        """Sends the spec and the descriptors it names; from here on the child is the caller's."""
        proc, self.proc = self.proc, None
        try:
            send_spec(self._sock, spec)
        except OSError:  # the child died while it imported: the launch sees it gone
            pass
        finally:
            self._sock.close()
        return proc

    def discard(self) -> None:
        """Ends a child never handed over (it holds nothing yet); a no-op after hand_over."""
        proc, self.proc = self.proc, None
        self._sock.close()
        if proc is not None:
            proc.kill()
            proc.wait()
