"""The parent's handle on one chip-child: start it, talk to it, stop it.

A child is a fresh interpreter (`python -m chip_child`), not a bare fork: torch's CPU build uses
GNU OpenMP, and a forked child of a parent that already ran a parallel region deadlocks in its
first one. The child inherits the shared buffers' descriptors and runs in its own session, so a
Ctrl-C aimed at the user's program reaches the parent, which then stops the children itself.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Callable

import msgpack
import zmq

from chip_child.config import RuntimeConfig
from chip_child.device import device_type
from chip_child.protocol import Shutdown, encode
from chip_child.child_spec import ChildSpec
from l3worker.errors import ChildDiedError, ChildError, StepTimeoutError, StoppingError
from l3worker.worker.early_child import EarlyChild, child_env
from l3worker.worker.shared_buffers import StepBuffers

LIVENESS_POLL_MS = 100
STARTUP = "start-up (device, weights, KV cache, warm-up)"


def child_spec(rank: int, runtime: RuntimeConfig, buffers: StepBuffers, socket_dir: str, **options) -> ChildSpec:
    """The spec of one rank: its runtime config and the ring it maps; `options` are ChildSpec's
    optional fields."""
    return ChildSpec(rank, socket_dir, asdict(runtime), {k: v.to_json() for k, v in buffers.specs.items()},
                     **options)


def wait_all_ready(children: list["ChildProcess"], timeout_s: float | None, cancel: threading.Event | None = None,
                   check: Callable[[], None] | None = None) -> None:
    """Waits for every child's ready report, watching all of them meanwhile: tensor-parallel ranks
    meet at start-up, so when one dies the others wait on it forever. `check` runs between polls."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(children)
    poller = zmq.Poller()
    for child in pending:
        poller.register(child.sock, zmq.POLLIN)
    while pending:
        events = dict(poller.poll(LIVENESS_POLL_MS))
        for child in [c for c in pending if c.sock in events]:
            child.wait_ready(timeout_s, cancel)
            pending.remove(child)
            poller.unregister(child.sock)
        for child in pending:
            child.check_alive(STARTUP)
        check_cancel(cancel)
        if check is not None:
            check()
        if pending and deadline is not None and time.monotonic() > deadline:
            raise StepTimeoutError(f"chip-child {pending[0].rank} (pid {pending[0].pid}) gave no reply to {STARTUP} "
                                   f"within {timeout_s:g}s")


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise StoppingError("the engine is stopping")


class ChildProcess:
    def __init__(self, ctx: zmq.Context, spec: ChildSpec, buffers: StepBuffers, early: EarlyChild | None = None):
        """Starts the child, or hands `early` (a cpu child already started) its spec."""
        self.spec = spec
        self.rank = spec.rank
        self.socket_path = spec.socket_path
        self._doorbell = buffers.doorbell.numpy()
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(spec.endpoint)
            if early is not None:
                self.proc = early.hand_over(spec)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "chip_child", spec.to_json()], pass_fds=spec.fds,
                    env=child_env(cpu=device_type(spec.runtime["device"]) == "cpu"), stdin=subprocess.DEVNULL,
                    start_new_session=True)
        except BaseException:
            self.sock.close(0)
            raise
        self.info: dict = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, payload: bytes, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        """Queues a command. Never blocks on a dead or wedged child: a PAIR socket whose peer is
        gone takes no message, so a send that cannot go out at once waits in short polls that check
        the child is alive, `cancel`, and `timeout_s`."""
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._wait_for(zmq.POLLOUT, deadline, "a command to be taken", cancel,
                           lambda: f"took no command within {timeout_s:g}s")
            try:
                self.sock.send(payload, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                continue

    def _wait_for(self, event: int, deadline: float | None, what: str, cancel: threading.Event | None,
                  timed_out: Callable[[], str]) -> None:
        """Polls the socket for `event` in short slices, checking between them that the child is
        alive, `cancel` and the deadline, so no wait on a child can last forever."""
        while not self.sock.poll(LIVENESS_POLL_MS, event):
            self.check_alive(what)
            check_cancel(cancel)
            if deadline is not None and time.monotonic() > deadline:
                raise StepTimeoutError(f"chip-child {self.rank} (pid {self.pid}) {timed_out()}")

    def check_alive(self, what: str) -> None:
        code = self.proc.poll()
        if code is not None:
            raise ChildDiedError(f"chip-child {self.rank} (pid {self.pid}) exited with code {code} "
                                 f"while the parent waited for {what}")

    def recv(self, timeout_s: float | None, what: str, cancel: threading.Event | None = None) -> dict:
        """The next report (ready, or an error, which raises), skipping wake-ups; raises if the
        child dies, `cancel` is set or `timeout_s` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._wait_for(zmq.POLLIN, deadline, what, cancel, lambda: f"gave no reply to {what} within {timeout_s:g}s")
            reply = self._unpack(self._read(), what)
            if isinstance(reply, dict):
                return reply

    def control_reply(self, timeout_s: float | None, cancel: threading.Event | None = None) -> dict:
        """The reply to a control (chip_child.protocol.Control) sent before; its refusal raises ValueError."""
        reply = self.recv(timeout_s, "a control", cancel)
        if "refused" in reply:
            raise ValueError(reply["refused"])
        return reply

    def drain(self) -> None:
        """Consumes every waiting message: wake-ups are dropped, an error reply raises."""
        while True:
            try:
                raw = self._read(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unpack(raw, "a step")

    def _read(self, flags: int = 0) -> bytes:
        return self.sock.recv(flags)

    def _unpack(self, raw: bytes, what: str) -> object:
        reply = msgpack.unpackb(raw)
        if isinstance(reply, dict) and "error" in reply:
            self._doorbell[2] = 0  # this error is now the parent's
            step = reply.get("step")
            where = f"step {step}" if step is not None else what
            tb = reply.get("traceback") or ""
            raise ChildError(f"chip-child {self.rank} failed on {where}: {reply['error']}" + (f"\n{tb}" if tb else ""))
        return reply

    def wait_ready(self, timeout_s: float | None, cancel: threading.Event | None = None) -> dict:
        self.info = self.recv(timeout_s, STARTUP, cancel)
        return self.info

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """Asks the child to exit, then kills it after `grace_s`. A dead child costs no wait."""
        if self.proc.poll() is None:
            try:
                self.sock.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:  # hung in a step: it ignores SIGTERM while we live
                self.proc.kill()
                self.proc.wait()
        self.sock.close(0)
