"""The server's one door to the engine: engine.generate with API errors and in-flight tracking.
Leaving a request's stream early, for any reason, closes the engine's stream, and the engine's
front (AsyncEngine.generate) aborts a request whose stream closes unfinished: the one place a
request is aborted, except `abort_all` at shutdown."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, TypeVar

from l3worker.errors import EngineAsleepError, EngineBusyError, RequestFailedError, WorkerError
from l3worker.params import RequestOutput, SamplingParams
from l3worker.serving.openai.errors import bad_request, request_failed, unavailable

log = logging.getLogger("l3worker.serving")
T = TypeVar("T")


class EngineClient:
    def __init__(self, engine):
        self.engine = engine
        self.inflight: set[str] = set()
        self.stopping = False

    @property
    def dead(self) -> bool:
        return bool(self.engine.dead)

    @property
    def healthy(self) -> bool:
        """What /health says: false once the engine stopped and while its children restart."""
        return not self.stopping and bool(self.engine.healthy)

    @property
    def weight_version(self) -> str:
        """The weights' version (update_weights_from_disk's weight_version; "default" at start)."""
        return self.engine.weight_version

    async def control(self, name: str, args: dict) -> dict:
        """engine.control (a rollout control, l3worker/serving/controls.py), with bad input as a 400
        (the worker's words, naming the tensor or field) and a stopped engine as a 503."""
        if self.stopping:
            raise unavailable("the server is shutting down")
        try:
            return await self.engine.control(name, args)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        except WorkerError as e:
            raise unavailable(f"the engine failed: {e}") from None

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """engine.generate, with its input errors (raised before the first output) as 400s and a dead
        engine as 503. Leaving early for any reason aborts the request."""
        if self.stopping:
            raise unavailable("the server is shutting down")
        if self.dead:
            raise unavailable(f"the engine is dead: {self.engine.error!r}")
        if not self.engine.accepting:  # e.g. restarting children that wait on another node: 503 now, as /health
            raise unavailable(f"the engine is not serving now: {self.engine.unavailable_reason}")
        self.inflight.add(request_id)
        started = False
        outputs = self.engine.generate(prompt, params, request_id, lora_request=lora_request)
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
                except EngineAsleepError as e:  # the worker's words: "the engine sleeps: wake_up() first", ...
                    raise unavailable(str(e), code="engine_asleep") from None
                except EngineBusyError as e:
                    raise unavailable(str(e), code="server_overloaded") from None
                except RequestFailedError as e:
                    raise request_failed(str(e)) from None
                except WorkerError as e:
                    raise unavailable(f"the engine failed: {e}") from None
                started = True
                yield out
        finally:
            self.inflight.discard(request_id)
            # Now, not when the collector finds it: the engine aborts the request if it is unfinished.
            await outputs.aclose()

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
