"""The server's one door to the engine: engine.generate with API errors, in-flight tracking and
abort on every way out (client gone, handler cancelled, server stopping)."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request

from l3worker.errors import WorkerError
from l3worker.params import RequestOutput, SamplingParams
from l3worker.server.errors import bad_request, unavailable

log = logging.getLogger("l3worker.server")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was complete; its requests were aborted."""


class EngineClient:
    def __init__(self, engine):
        self.engine = engine
        self.inflight: set[str] = set()
        self.stopping = False
        self._background: set[asyncio.Task] = set()

    @property
    def dead(self) -> bool:
        return bool(self.engine.dead)

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """engine.generate, with its input errors (raised before the first output) as 400s and a dead
        engine as 503. Leaving early for any reason aborts the request."""
        if self.stopping:
            raise unavailable("the server is shutting down")
        if self.dead:
            raise unavailable(f"the engine is dead: {self.engine.error!r}")
        self.inflight.add(request_id)
        finished = False
        started = False
        outputs = self.engine.generate(prompt, params, request_id)
        try:
            while True:
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    break
                except (ValueError, TypeError) as e:
                    if started:
                        raise
                    raise bad_request(str(e)) from None
                except WorkerError as e:
                    raise unavailable(f"the engine failed: {e}") from None
                started = True
                finished = finished or out.finished
                yield out
        finally:
            self.inflight.discard(request_id)
            if not finished:
                self._in_background(self._abort(outputs, request_id))

    async def _abort(self, outputs, request_id: str) -> None:
        try:
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()
            if not self.dead:
                await self.engine.abort(request_id)
        except Exception:  # an abort that fails leaves nothing to clean up on this side
            log.debug("abort of %s failed", request_id, exc_info=True)

    def _in_background(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort_all(self) -> None:
        """Stops taking requests and aborts every one in flight (server shutdown)."""
        self.stopping = True
        for request_id in list(self.inflight):
            try:
                await self.engine.abort(request_id)
            except Exception:
                log.debug("abort of %s failed", request_id, exc_info=True)


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several iterators as they come, tagged with the iterator's index. The first error
    ends the whole; leaving early cancels (and so aborts) the others."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientDisconnected (after cancelling it, which aborts its requests)
    if the client closes the connection first. Needs the body to have been read already."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientDisconnected()
