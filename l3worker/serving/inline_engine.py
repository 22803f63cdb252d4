"""The engine stepped by the server's own event loop: `l3worker serve --inline-engine`.

With one API server and one engine, the engine can live in the API server's process without a
thread of its own. The leader child's eventfd (l3worker/worker/doorbell.py) is a reader on the
event loop: when a step completes, the loop reads its tokens, sends the next command and writes
the streamed chunks, in one wake-up of one thread (and of the ZeroMQ thread that carries the
command). The default layout wakes five threads in two processes for the same token (the engine
core's loop thread and two ZeroMQ threads, the API server's ZeroMQ thread and its event loop), and
on a machine whose cores the child's threads fill, each wake-up preempts the step.

The loop never waits on a child here: `Engine.step(wait=False)` sends commands and completes a
step only once it is done. What has to wait goes to the executor, as AsyncEngine's loop thread
would run it, while the event loop leaves the engine alone:
- a control (sleep, weight updates, pause), which drains the steps in flight;
- a step that has not completed within WATCH_S: the blocking wait there notices a child that
  died, raised or hung, and the engine restarts the children as it always does;
- the idle engine's liveness check (Engine.watch), every WATCH_S.
"""
from __future__ import annotations

import asyncio
import os
import platform
import threading
from typing import Callable

from chip_child.device import move_threads_off
from l3worker.params import RequestOutput
from l3worker.serving.async_engine import AsyncEngine, EngineDeadError
from l3worker.worker.child_process import LIVENESS_POLL_MS
from l3worker.worker.doorbell import ORDERED_STORES

WATCH_S = LIVENESS_POLL_MS / 1000


def inline_refusal(api_server_count: int, data_parallel_size: int, remote: bool) -> str | None:
    """Why --inline-engine cannot serve this layout, or None."""
    if not hasattr(os, "eventfd"):
        return "--inline-engine needs an OS with eventfd (Linux)"
    if not ORDERED_STORES:  # step_ready() reads the doorbell, then the ring, with no fence between
        return f"--inline-engine needs a cpu that keeps stores in order (x86), not {platform.machine()}"
    if api_server_count != 1:
        return f"--inline-engine serves from one API server, got --api-server-count {api_server_count}"
    if data_parallel_size != 1 or remote:
        return "--inline-engine runs one engine on this node: no --data-parallel-size or other nodes"
    return None


class InlineEngine(AsyncEngine):
    def __init__(self, worker):
        super().__init__(worker)
        self._busy: asyncio.Future | None = None  # an executor call that has the engine now
        self._reader: int | None = None  # the eventfd registered on the loop
        self._timer: asyncio.TimerHandle | None = None
        self._progress_at = 0.0  # loop time of the last step completed here, or handed back
        self._pump_queued = False

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, self.worker.prepare)
        move_threads_off(self.worker.step_core)  # the core of the chip-child's step thread is its own
        if (why := inline_refusal(1, 1, False)) or self.engine.wake_fd is None:
            raise RuntimeError(why or "--inline-engine: the chip-child has no eventfd to wake the event loop with")
        self.engine.driven_by_loop_thread = True  # controls queue for the loop, which hands them off
        self._thread = threading.current_thread()  # the thread that steps the engine: this loop's
        self.engine.on_work = self._wake
        self._listen()
        self._progress_at = self._loop.time()
        self._timer = self._loop.call_later(WATCH_S, self._watch)

    # -- wake-ups ----------------------------------------------------------------------------------
    def _wake(self) -> None:
        """Engine.on_work, from any thread: a request, an abort, a control or a grammar came in."""
        if self._pump_queued or self._closed:
            return
        self._pump_queued = True
        try:
            self._loop.call_soon_threadsafe(self._pump)
        except RuntimeError:  # the loop closed: the server is gone
            pass

    def _on_step_done(self) -> None:
        try:
            os.eventfd_read(self._reader)  # clears the count: the next readiness is a later step
        except BlockingIOError:
            pass
        self._pump()

    def _listen(self) -> None:
        fd = self.engine.wake_fd
        if fd is not None and self._reader is None:
            self._loop.add_reader(fd, self._on_step_done)
            self._reader = fd

    def _unlisten(self) -> None:
        if self._reader is not None:
            self._loop.remove_reader(self._reader)
            self._reader = None

    # -- stepping ----------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Steps while the step awaited has completed, and once more after the last of them: that
        one sends the next command before the loop writes any chunk (the child must not wait)."""
        self._pump_queued = False
        if self._busy is not None or self._stopping or self.dead:
            return
        engine = self.engine
        try:
            while True:
                if engine.control_pending:
                    return self._hand_off(engine.step)
                completes = engine.step_ready()
                outputs = engine.step(wait=False)  # tops up the commands in flight first
                if outputs:
                    self._dispatch(outputs)
                if not completes:
                    break
                self._progress_at = self._loop.time()
        except BaseException as exc:  # a child failed past the restart budget, or the engine stopped
            self._died(exc)

    def _watch(self) -> None:
        if self._stopping:
            return
        self._timer = self._loop.call_later(WATCH_S, self._watch)
        if self._busy is not None or self.dead:
            return
        engine = self.engine
        if not engine.has_unfinished():
            self._hand_off(engine.watch)
        elif engine.step_ready():
            self._pump()
        elif self._loop.time() - self._progress_at > WATCH_S:
            self._hand_off(engine.step)  # waits there, watching the children as it waits

    def _hand_off(self, call: Callable[[], list[RequestOutput]]) -> None:
        """Runs `call` (a step that may wait, a control, the liveness check) in the executor; the
        event loop neither steps nor reads the eventfd meanwhile."""
        self._unlisten()
        self._busy = asyncio.ensure_future(self._loop.run_in_executor(None, call))
        self._busy.add_done_callback(self._handed_back)

    def _handed_back(self, done: asyncio.Future) -> None:
        self._busy = None
        if self._stopping:
            return
        try:
            outputs = done.result()
        except BaseException as exc:
            return self._died(exc)
        self._progress_at = self._loop.time()
        self._listen()
        if outputs:
            self._dispatch(outputs)
        self._pump()

    def _died(self, exc: BaseException) -> None:
        """As AsyncEngine's loop thread does: the engine stops, every stream ends with the error."""
        self.engine.fail(exc)
        self._unlisten()
        self._fail_waiters(EngineDeadError(f"the engine stopped: {exc}"))
        self._loop.run_in_executor(None, self.worker.close)

    async def _stop_stepping(self) -> None:
        """AsyncEngine.shutdown's wait: no timer, no reader, and a call handed off has returned
        (a wait there gives up at its next liveness poll once the engine is told to stop)."""
        if self._timer is not None:
            self._timer.cancel()
        self._unlisten()
        if self._busy is not None:
            await asyncio.wait([self._busy])
        self.engine.on_work = lambda: None
