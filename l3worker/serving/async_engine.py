"""The asyncio front of the engine, for servers: the step loop runs in a thread of its own.

Coroutines add requests at any moment and read their outputs from an asyncio queue; the loop
thread hands each step's outputs to the event loop in one call. Closing or cancelling a request's
iterator (a client gone) aborts it. With nothing to do the loop thread sleeps on an event, and
wakes every WATCH_S to check its children: a death is noticed, and the children restarted, even
when no request runs. Rollout controls (control()) wait for the loop thread in the executor's.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from prometheus_client import generate_latest

from l3worker.engine.step_loop import EngineDeadError
from l3worker.worker.shared_weights import BUCKET_BYTES
from l3worker.errors import RequestFailedError
from l3worker.params import RequestOutput, SamplingParams
from l3worker.serving.controls import run_control
from l3worker.worker.distributed_worker import DistributedWorker

__all__ = ["AsyncEngine", "EngineDeadError", "checked", "run_step_loop"]

WATCH_S = 0.25


def checked(item: RequestOutput | BaseException) -> RequestOutput:
    """A stream's next item, from a serving driver's queue: an exception put there (the engine
    stopped) is raised, as is RequestFailedError for a request the engine gave up on."""
    if isinstance(item, BaseException):
        raise item
    if item.error is not None:
        raise RequestFailedError(item.error)
    return item


def run_step_loop(worker: DistributedWorker, stopping: Callable[[], bool],
                  emit: Callable[[list[RequestOutput]], None], on_dead: Callable[[BaseException], None]) -> None:
    """The serving drivers' loop thread (AsyncEngine's here, the engine-core process's): steps while
    requests run, otherwise sleeps on the inbox and watches the children; hands each step's outputs
    to `emit` in one call. A failure the engine cannot recover from closes the worker, then
    `on_dead(exc)`: every open stream ends with it."""
    engine = worker.engine
    try:
        while not stopping():
            if not engine.has_unfinished():
                engine.wait_for_work(WATCH_S)
                outputs = engine.watch()
            else:
                outputs = engine.step()
            if outputs:
                emit(outputs)
    except BaseException as exc:  # a child died, raised or hung
        engine.fail(exc)
        worker.close()
        on_dead(exc)


class AsyncEngine:
    def __init__(self, worker: DistributedWorker):
        self.worker = worker
        self.engine = worker.engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    @property
    def registry(self):
        return self.engine.metrics.registry

    async def metrics_text(self) -> bytes:
        """The engine's /metrics exposition."""
        return generate_latest(self.registry)

    @property
    def dead(self) -> bool:
        return self.engine.error is not None

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    @property
    def healthy(self) -> bool:
        """Serving now: false once the engine stopped, and while its children restart on other nodes."""
        return self._thread is not None and not self._stopping and self.engine.healthy

    @property
    def accepting(self) -> bool:
        """New requests are taken now: exactly when /health says 200."""
        return self.healthy

    @property
    def unavailable_reason(self) -> str | None:
        """Why no request is taken now (None while `accepting`)."""
        if self.accepting:
            return None
        if self._thread is None or self._stopping:
            return "the engine is not running"
        return self.engine.unavailable_reason

    async def start(self) -> None:
        """Prepares the worker (starts the chip-children) and starts the loop thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, self.worker.prepare)
        self.engine.driven_by_loop_thread = True
        self._thread = threading.Thread(target=self._run, name="l3worker-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they arrive: deltas, then the final one. Bad input raises
        ValueError/TypeError before anything is yielded; a dead engine raises EngineDeadError, a full
        queue EngineBusyError, and a request the engine gave up on RequestFailedError."""
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running")
        state = self.engine.make_request(prompt, params, request_id, True, "prompt", lora_request=lora_request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[state.request_id] = queue
        finished = False
        try:
            self.engine.submit(state)
            while not finished:
                item = checked(await queue.get())
                finished = item.finished
                yield item
        finally:
            self._queues.pop(state.request_id, None)
            if not finished:
                self.engine.abort(state.request_id)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def control(self, name: str, args: dict) -> dict:
        """Runs rollout control `name` (l3worker/serving/controls.py) between two steps; the worker's
        ValueError for bad input, EngineDeadError once the engine stopped."""
        if self.dead:
            raise self.engine.dead_error()
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running")
        return await asyncio.get_running_loop().run_in_executor(None, run_control, self.worker, name, args)

    async def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None,
                                         flush: bool = True, bucket_bytes: int = BUCKET_BYTES) -> dict:
        """DistributedWorker.update_weights_from_tensor, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.worker.update_weights_from_tensor(named_tensors, weight_version, flush, bucket_bytes))

    @property
    def weight_version(self) -> str:
        return self.worker.weight_version

    async def shutdown(self) -> None:
        """Aborts what is in flight, stops the loop thread and closes the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self.engine.request_stop()  # a wait on a hung child or a restart gives up
        await self._stop_stepping()
        self._fail_waiters(EngineDeadError("the server is shutting down"))
        await asyncio.get_running_loop().run_in_executor(None, self.worker.close)

    async def _stop_stepping(self) -> None:
        """Returns once nothing steps the engine any more: here, the loop thread has ended."""
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # -- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        run_step_loop(self.worker, lambda: self._stopping,
                      lambda outputs: self._loop.call_soon_threadsafe(self._dispatch, outputs),
                      lambda exc: self._loop.call_soon_threadsafe(
                          self._fail_waiters, EngineDeadError(f"the engine stopped: {exc}")))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_waiters(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
