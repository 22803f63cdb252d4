"""An API server's engine when the engine runs in an engine-core process (`l3worker serve`).

It offers what the server asks of AsyncEngine (generate, abort, health, the metrics exposition,
start and shutdown) over the wire of l3worker/serving/core_wire.py. Each API server has, per engine core
(`--data-parallel-size`), a control DEALER (requests, aborts, scrapes in; health and refusals
back), and one outputs PULL it binds, where every core's step loop sends one message per step.
With several engine cores, a Router (server/router.py) picks each request's engine.

An engine core's death is seen at once: a pidfd on each core's process sits in the event loop,
and its readiness fails every open stream and turns /health and new requests into 503s (one dead
engine stops the service: its requests are gone, as vLLM does). An engine on another node that is
lost (its relay, l3worker/distributed/dp_remote.py, says ["lost", text] on its control socket) fails
its own requests, leaves the router and turns /health into 503; the others keep serving what is
routed to them. When it registers again (["back"]), it is asked "hello" and rejoins on its answer.
A rollout control (control()) goes to every engine that is not lost, and their replies are combined
(controls.combine); each core says its weight_version at hello, in each reply, and whenever it changes.
All metrics live in the cores:
whichever API server answers a scrape asks every core and shows each engine's series under an
`engine` label.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from typing import AsyncIterator, Awaitable, Callable

import zmq
import zmq.asyncio

from chip_child.device import move_threads_off
from l3worker.serving.controls import combine, push_tensors
from l3worker.serving.core_wire import error_from_wire, identity, output_from_wire, pack, params_to_wire, unpack
from l3worker.engine.metrics import exposition
from l3worker.serving.async_engine import checked
from l3worker.engine.step_loop import EngineDeadError
from l3worker.engine.requests import DEFAULT_PARAMS
from l3worker.params import RequestOutput, SamplingParams
from l3worker.distributed.kv_event_feed import KVEventFeed
from l3worker.distributed.router import Router
from l3worker.worker.shared_weights import BUCKET_BYTES

log = logging.getLogger("l3worker.serving")
METRICS_TIMEOUT_S = 10.0


class _Outputs:
    """A request's outputs its stream has not taken yet. When the stream falls behind (a busy API
    server), the deltas of several steps merge into one output, so it writes one SSE event for
    them instead of one per step (vLLM's output collector does the same); a stream that keeps up
    sees every step."""

    def __init__(self) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._items[-1] = merge_outputs(last, item)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.pop(0)


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output with the deltas of `old` then `new` (its successor), and `new`'s other fields."""
    samples = {s.index: s for s in old.outputs}
    for s in new.outputs:
        prev = samples.get(s.index)
        if prev is not None:
            s.delta_token_ids = prev.delta_token_ids + s.delta_token_ids
            s.delta_text = prev.delta_text + s.delta_text
            if s.delta_logprobs is not None:
                s.delta_logprobs = (prev.delta_logprobs or []) + s.delta_logprobs
        samples[s.index] = s
    new.outputs = sorted(samples.values(), key=lambda s: s.index)
    if new.prompt_logprobs is None:
        new.prompt_logprobs = old.prompt_logprobs
    return new


class CoreClient:
    def __init__(self, index: int, controls: list[str], outputs: str, core_pids: list[int],
                 router: Router | None = None,
                 on_shutdown: Callable[["CoreClient"], Awaitable[None]] | None = None):
        self.index = index  # this API server's
        self.core_pids = core_pids
        self.router = router  # None: one engine core
        self.error: BaseException | None = None
        self.cpu_layout: str | None = None  # what the core's cpu children run with (its ready reply); None off the cpu
        self.step_core: int | None = None  # where a lone engine core's chip-child steps alone (its ready reply)
        self._on_shutdown = on_shutdown  # the launching API server's: stops the processes it started
        self._ctx = zmq.asyncio.Context()
        # A plain socket read from the event loop's own reader on its fd (_on_outputs): every
        # token of every stream passes here, and pyzmq's asyncio wrapper spends a future, a
        # callback and a poller update on each message.
        self._pull = zmq.Socket(self._ctx, zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(outputs)  # before the cores start: nothing they send is lost
        self._controls = []
        for endpoint in controls:
            control = self._ctx.socket(zmq.DEALER)
            control.setsockopt(zmq.IDENTITY, identity(index))
            control.setsockopt(zmq.LINGER, 0)
            control.connect(endpoint)
            self._controls.append(control)
        self._queues: dict[str, _Outputs] = {}
        self._prompts: dict[str, list[int]] = {}
        self._engine_of: dict[str, int] = {}
        self._scrapes: dict[tuple[int, int], asyncio.Future] = {}
        self._calls: dict[tuple[int, int], asyncio.Future] = {}  # rollout controls awaiting their reply
        self._versions = ["default"] * len(controls)  # each engine's weight_version
        self._seq = itertools.count()
        self._core_healthy = [False] * len(controls)
        self._core_why: list[str | None] = [None] * len(controls)  # why an engine does not serve (its word)
        self._lost: dict[int, str] = {}  # remote engines gone: why
        self._stopping = False
        self._closed = False
        self._pidfds: list[int] = []
        self._gone: list[asyncio.Future] = []
        self._tasks: list[asyncio.Task] = []
        # The engines' KV events, when they publish them: the router follows what they hold.
        self.kv_feed = KVEventFeed(self._ctx, router) if router and router.config.events_endpoints else None

    @property
    def dead(self) -> bool:
        return self.error is not None

    @property
    def weight_version(self) -> str:
        """The engines' weight_version (joined by "/" where data-parallel engines differ)."""
        return "/".join(dict.fromkeys(self._versions))

    @property
    def healthy(self) -> bool:
        return not self._stopping and self.error is None and all(self._core_healthy)

    @property
    def accepting(self) -> bool:
        """New requests are taken now: some engine serves (with one engine: exactly when /health
        says 200; a lost data-parallel engine turns /health 503 while the others still serve)."""
        return not self._stopping and self.error is None and any(self._core_healthy)

    @property
    def unavailable_reason(self) -> str | None:
        """Why no request is taken now, in the engines' words (None while `accepting`)."""
        if self.accepting:
            return None
        if self._stopping:
            return "the server is shutting down"
        if self.error is not None:
            return str(self.error)
        return "; ".join(dict.fromkeys(why or self._lost.get(e) or f"data-parallel engine {e} is not serving"
                                       for e, why in enumerate(self._core_why)))

    async def start(self) -> None:
        """Waits until every engine core serves (they may still be loading the model). Raises
        EngineDeadError if one's process exits first."""
        loop = asyncio.get_running_loop()
        for engine, pid in enumerate(self.core_pids):
            self._gone.append(loop.create_future())
            self._pidfds.append(os.pidfd_open(pid))
            loop.add_reader(self._pidfds[-1], self._core_exited, engine)
        for control in self._controls:
            await control.send(pack(["hello"]))
        layouts = []
        for engine, control in enumerate(self._controls):
            while True:  # a health change may come before the reply
                reply = asyncio.ensure_future(control.recv())
                await asyncio.wait({reply, *self._gone}, return_when=asyncio.FIRST_COMPLETED)
                if not reply.done():
                    reply.cancel()
                    raise self.error or EngineDeadError("an engine-core process (or the relay of the engines on "
                                                        "other nodes) exited while starting: see its log")
                msg = unpack(reply.result())
                if msg[0] == "lost":
                    raise EngineDeadError(msg[1])
                if msg[0] == "health":
                    self._core_healthy[engine], self._core_why[engine] = msg[1], msg[2]
                elif msg[0] == "ready":
                    self._ready(engine, msg)
                    layouts.append(msg[2])
                    break
        # Data-parallel engines on a cpu each run their own layout: one word when they agree.
        self.cpu_layout = "/".join(dict.fromkeys(x for x in layouts if x)) or None
        move_threads_off(self.step_core)
        loop.add_reader(self._pull.FD, self._on_outputs)
        self._on_outputs()  # what came before the reader: its fd signals only new arrivals
        self._tasks = [*(asyncio.ensure_future(self._read_control(e)) for e in range(len(self._controls))),
                       *(self.kv_feed.tasks() if self.kv_feed else ())]
        if self.kv_feed:  # the engines publish from their first request: be subscribed by then
            await self.kv_feed.subscribed()

    async def generate(self, prompt: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate. The core checks the request; a refusal is raised before any output."""
        if self._stopping or not self._gone:
            raise EngineDeadError("the engine is not running")
        if self.error is not None:
            raise self.error
        if len(self._lost) == len(self._controls):
            raise EngineDeadError(f"every engine is lost: {'; '.join(self._lost.values())}")
        params = params or DEFAULT_PARAMS  # greedy, as AsyncEngine's in-process engine
        request_id = request_id or uuid.uuid4().hex
        queue = self._queues[request_id] = _Outputs()
        self._prompts[request_id] = list(prompt)
        engine = self._engine_of[request_id] = self.router.choose(prompt) if self.router else 0
        finished = False
        try:
            lora = None if lora_request is None else [lora_request.lora_name, lora_request.lora_int_id,
                                                      lora_request.lora_path]
            await self._controls[engine].send(pack(["add", request_id, self._prompts[request_id],
                                                    params_to_wire(params), lora]))
            while not finished:
                item = checked(await queue.get())
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._prompts.pop(request_id, None)
            if self.router:
                self.router.finished(engine)
            if not finished and self.error is None and not self._closed:
                await self.abort(request_id)
            self._engine_of.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        engine = self._engine_of.get(request_id)
        if engine is not None and engine not in self._lost:
            await self._controls[engine].send(pack(["abort", request_id]))

    async def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None,
                                         flush: bool = True, bucket_bytes: int = BUCKET_BYTES) -> dict:
        """DistributedWorker.update_weights_from_tensor, for the engine core(s) behind this client:
        the tensors cross through shared memory, bucket by bucket (controls.push_tensors)."""
        return await push_tensors(self.control, named_tensors, weight_version, flush, bucket_bytes)

    async def control(self, name: str, args: dict) -> dict:
        """Runs rollout control `name` (l3worker/serving/controls.py) on every engine that is not
        lost and combines their results; the first engine's error is raised (ValueError for bad
        input, EngineDeadError when one stops first)."""
        if self._stopping or not self._gone:
            raise EngineDeadError("the engine is not running")
        if self.error is not None:
            raise self.error
        engines = [e for e in range(len(self._controls)) if e not in self._lost]
        if not engines:
            raise EngineDeadError(f"every engine is lost: {'; '.join(self._lost.values())}")
        seq = next(self._seq)
        loop = asyncio.get_running_loop()
        futures = [self._calls.setdefault((e, seq), loop.create_future()) for e in engines]
        try:
            for e in engines:
                await self._controls[e].send(pack(["control", seq, name, args]))
            replies = await asyncio.gather(*futures)  # no time limit: a weight update loads a checkpoint
        finally:
            for e in engines:
                self._calls.pop((e, seq), None)
        for ok, value, kind in replies:
            if not ok:
                raise error_from_wire(kind, value)
        return combine([value for _, value, _ in replies])

    async def metrics_text(self) -> bytes:
        """Every engine core's /metrics series in one exposition (empty once one is gone)."""
        if self._closed or not self._gone or any(g.done() for g in self._gone):
            return b""
        seq = next(self._seq)
        loop = asyncio.get_running_loop()
        engines = [e for e in range(len(self._controls)) if e not in self._lost]  # a lost one cannot answer
        futures = [self._scrapes.setdefault((e, seq), loop.create_future()) for e in engines]
        try:
            for e in engines:
                await self._controls[e].send(pack(["metrics", seq]))
            text = exposition(await asyncio.wait_for(asyncio.gather(*futures), METRICS_TIMEOUT_S))
            return text + self.kv_feed.exposition(self.index) if self.kv_feed else text
        finally:
            for e in engines:
                self._scrapes.pop((e, seq), None)

    async def shutdown(self) -> None:
        """Fails what still waits, stops the processes this server started (if it did), closes. Idempotent."""
        if self._closed:
            return
        self._stopping = True
        if self._on_shutdown is not None:
            await self._on_shutdown(self)
        self._closed = True
        self._fail_waiters(EngineDeadError("the server is shutting down"))
        for task in self._tasks:
            task.cancel()
        for engine in range(len(self._pidfds)):
            self._unwatch(engine)
        asyncio.get_running_loop().remove_reader(self._pull.FD)
        self._pull.close()  # not the context's: destroy() closes only the sockets it made
        self._ctx.destroy(linger=0)

    async def send_shutdown(self, engine: int) -> None:
        """Tells an engine core to stop (the launching API server, last)."""
        await self._controls[engine].send(pack(["shutdown"]))

    # -- readers -----------------------------------------------------------------------------------
    def _on_outputs(self) -> None:
        """Takes every message waiting on the outputs socket (its fd only says that something
        changed, so the socket is drained each time)."""
        pull = self._pull
        while not self._closed and pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = unpack(pull.recv(zmq.NOBLOCK))
            if msg[0] == "out":
                for item in msg[1]:
                    queue = self._queues.get(item[0])
                    if queue is not None:
                        queue.put(output_from_wire(item, self._prompts[item[0]]))
            elif msg[0] == "dead":
                self._die(EngineDeadError(f"the engine stopped: {msg[1]}"))

    async def _read_control(self, engine: int) -> None:
        control = self._controls[engine]
        while True:
            msg = unpack(await control.recv())
            kind = msg[0]
            if kind == "health":
                self._core_healthy[engine], self._core_why[engine] = msg[1], msg[2]
            elif kind == "refused":
                queue = self._queues.get(msg[1])
                if queue is not None:
                    queue.put(error_from_wire(msg[2], msg[3]))
            elif kind == "control":
                _, seq, ok, value, error = msg
                if ok:
                    self._versions[engine] = value["weight_version"]
                future = self._calls.get((engine, seq))
                if future is not None and not future.done():
                    future.set_result((ok, value, error))
            elif kind == "weight_version":
                self._versions[engine] = msg[1]
            elif kind == "metrics":
                future = self._scrapes.get((engine, msg[1]))
                if future is not None and not future.done():
                    future.set_result(msg[2])
            elif kind == "lost":
                self._lose(engine, msg[1])
            elif kind == "back":  # a lost remote engine registered again: ask how it is
                await control.send(pack(["hello"]))
            elif kind == "ready" and engine in self._lost:  # its answer: it serves again
                del self._lost[engine]
                self._ready(engine, msg)
                if self.router:
                    self.router.down.discard(engine)
                log.warning("data-parallel engine %d is back", engine)

    def _ready(self, engine: int, msg: list) -> None:
        """["ready", healthy, cpu layout, why, weight_version, step core]; without the version, it
        stays as it was."""
        self._core_healthy[engine], self._core_why[engine] = msg[1], msg[3]
        if len(msg) > 4:
            self._versions[engine] = msg[4]
        if len(msg) > 5 and self.router is None:  # one engine core, on this machine
            self.step_core = msg[5]

    def _lose(self, engine: int, text: str) -> None:
        """A remote engine is gone: its requests fail, the router skips it, /health says 503."""
        if engine in self._lost:
            return
        log.error("data-parallel engine %d is lost: %s", engine, text)
        self._lost[engine] = text
        self._core_healthy[engine] = False
        if self.router:
            self.router.down.add(engine)
        exc = EngineDeadError(text)
        for request_id, e in self._engine_of.items():
            if e == engine and request_id in self._queues:
                self._queues[request_id].put(exc)
        for (e, _), future in [*self._scrapes.items(), *self._calls.items()]:
            if e == engine and not future.done():
                future.set_exception(exc)

    def _core_exited(self, engine: int) -> None:
        self._unwatch(engine)
        if not self._gone[engine].done():
            self._gone[engine].set_result(None)
        if not self._stopping:
            log.error("the engine-core process %d (pid %d) exited", engine, self.core_pids[engine])
            self._die(EngineDeadError(f"engine-core process {engine} exited"))

    def _die(self, exc: EngineDeadError) -> None:
        if self.error is None:
            self.error = exc
        self._fail_waiters(exc)

    def _unwatch(self, engine: int) -> None:
        if self._pidfds[engine] >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfds[engine])
            os.close(self._pidfds[engine])
            self._pidfds[engine] = -1

    def _fail_waiters(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put(exc)
        for future in [*self._scrapes.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(exc)
