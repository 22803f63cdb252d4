"""The one step loop every caller shares: generate(), stream(), and the HTTP server.

`Engine.add_request` and `Engine.abort` may be called from any thread at any moment; they only
queue the change (input processing, l3worker/engine/requests.py, has checked the request by then), which
the loop applies at the start of its next step. `Engine.step` keeps up to `pipeline_depth`
commands in flight, reads one step's sampled ids (with stream_interval N, N steps') from the shared
ring and hands them to output processing (l3worker/engine/outputs.py: text, stops, deltas, final
outputs). This loop is the only part of the parent that talks to the children. One thread at a time
drives `step`: the caller's (generate / stream), an AsyncEngine's loop thread (async_engine.py), or
a server's event loop with step(wait=False) (inline_engine.py).

A child that dies, raises or hangs does not end the requests: the loop drops the commands in
flight, has the worker start fresh children (`relaunch`, the code prepare() uses) and resumes
every live request as a preempted one, within the budget of l3worker/engine/recovery.py.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from chip_child import protocol
from chip_child.config import RuntimeConfig
from chip_child.models.loader import ModelConfig
from l3worker.worker.child_process import ChildProcess
from l3worker.engine.between_steps import BetweenSteps
from l3worker.engine.grammar_gate import GrammarGate, attach_matchers
from l3worker.engine.kv_events import KVEventPublisher, KVEventsConfig
from l3worker.lora.registry import LoraRegistry, registration
from l3worker.worker.doorbell import Doorbell
from l3worker.errors import ChildFailure, EngineAsleepError, EngineBusyError, WorkerError
from l3worker.engine.gauges import num_queued, num_running, num_waiting
from l3worker.engine.metrics import EngineMetrics
from l3worker.engine.outputs import OutputProcessor, SlotLogprobs
from l3worker.params import RequestOutput, SamplingParams
from l3worker.engine.recovery import RestartBudget, RestartPolicy, blame
from l3worker.engine.requests import InputProcessor, RequestState
from l3worker.engine.scheduler import Scheduled, Scheduler
from l3worker.worker.shared_buffers import StepBuffers
from l3worker.engine.speculation import SpecCounts, speculative_tokens, take_speculative_step
from l3worker.engine.stats import StepRecord
from l3worker.engine.step_timing import StepTiming

log = logging.getLogger("l3worker.engine.step_loop")
# Starts fresh children: stops the old ones (every rank), then returns the new ones, ready, and
# their doorbell. Raises ChildFailure when one of them fails to start.
Relaunch = Callable[[], "tuple[list[ChildProcess], Doorbell]"]


class EngineDeadError(WorkerError):
    """The engine stopped after a failure (a chip-child died, raised or hung); it takes no requests."""


@dataclass
class _InFlight:
    scheduled: Scheduled
    command_bytes: int


class Engine:
    def __init__(self, model_config: ModelConfig, runtime_config: RuntimeConfig, tokenizer, model_dir: str,
                 pipeline_depth: int, step_timeout_s: float | None, max_num_batched_tokens: int,
                 enable_prefix_caching: bool, restart_policy: RestartPolicy = RestartPolicy(0),
                 max_waiting_requests: int | None = None):
        self.model_config = model_config
        self.runtime_config = runtime_config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.pipeline_depth = pipeline_depth
        self.step_timeout_s = step_timeout_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.max_waiting_requests = max_waiting_requests  # None: no limit
        self.restarts = RestartBudget(restart_policy)
        self.restarting = False  # fresh children are starting: requests queue meanwhile
        self.restart_waits_on_nodes = False  # a restart waits for follower nodes (set by the worker)
        self.scheduling_policy = "fcfs"  # or "priority" (set by the worker): see Scheduler.priority
        self.kv_events_config: KVEventsConfig | None = None  # set by the worker: publish KV events
        self.kv_events_rank: int | None = None  # the data-parallel rank the events name
        self.kv_events: KVEventPublisher | None = None  # made at the first bind
        self.loras: LoraRegistry | None = None  # set by the worker with enable_lora
        self.stopping = threading.Event()  # set by request_stop(): waits on children give up
        self.scheduler: Scheduler | None = None
        self.metrics = EngineMetrics(running=lambda: num_running(self.requests),
                                     waiting=lambda: num_waiting(self.requests, self._inbox),
                                     kv_usage=lambda: self.scheduler.pages.usage if self.scheduler is not None else 0.0)
        self.input_processor = InputProcessor(model_config, runtime_config, tokenizer, model_dir)
        self.output_processor = OutputProcessor(tokenizer, self.metrics,
                                                lambda seq, reason, stop: self.scheduler.finish(seq, reason, stop))
        self.speculation = SpecCounts(speculative_tokens(runtime_config), self.metrics)
        self.step_timing = StepTiming()
        self.error: BaseException | None = None
        self.driven_by_loop_thread = False  # an AsyncEngine owns step()
        self._children: list[ChildProcess] = []
        self._buffers: StepBuffers | None = None
        self._doorbell: Doorbell | None = None
        self._relaunch: Relaunch | None = None
        self._sampled: list[np.ndarray] = []  # per ring slot: the sampled ids (a view of the ring)
        self._staging: list[np.ndarray] = []  # per ring slot: the prompt ids a step reads
        self._step_stats: np.ndarray | None = None
        self._slot_logprobs: list[list[SlotLogprobs]] = []  # per ring slot, per token position of a step
        self._inflight: deque[_InFlight] = deque()
        # ("add", RequestState) / ("abort", request_id) / ("call", BetweenSteps)
        self._inbox: deque[tuple[str, object]] = deque()
        self.paused = False  # pause_generation: no step is sent; requests keep their rows and pages
        self.refusal: str | None = None  # why new requests are refused now (asleep), or None
        self._held: list[RequestOutput] = []  # outputs of steps completed between steps (a drain)
        self._work = threading.Event()  # set whenever the inbox gets something, or a grammar compiled
        self.on_work: Callable[[], None] = lambda: None  # also told then (a driver on an event loop)
        self._gate = GrammarGate(self._signal)  # requests whose grammar is compiling wait here
        self._last_done = time.perf_counter()
        self._live_ids: set[str] = set()
        self._ids_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self, children: list[ChildProcess], buffers: StepBuffers, doorbell: Doorbell,
             relaunch: Relaunch | None = None) -> None:
        """Attaches the started children; requests queued before this are admitted at the first step.
        `relaunch` replaces failed children (None: a failure stops the engine)."""
        cfg = self.runtime_config
        self._children, self._buffers, self._doorbell = children, buffers, doorbell
        self._relaunch = relaunch
        self.scheduler = Scheduler(
            max_batch_size=cfg.max_batch_size, page_size=cfg.page_size, max_blocks_per_row=cfg.max_blocks_per_row,
            num_pages=cfg.total_pages - 1, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching, full_state=cfg.copy_policy == "always",
            speculative_tokens=self.speculation.k, priority=self.scheduling_policy == "priority",
            host_pages=cfg.host_kv_pages, loras=self.loras,
        )
        self._counted = (0, 0, 0)  # prefix cache queries and hits, preemptions: already in the metrics
        self._inflight.clear()
        if self.kv_events_config is not None:
            if self.kv_events is None:
                self.kv_events = KVEventPublisher(self.kv_events_config, cfg.page_size, self.kv_events_rank)
            self.scheduler.pages.events = []
        # Numpy views of the ring, made once: indexing a tensor every step costs microseconds.
        self._sampled = list(buffers.sampled.numpy())
        self._staging = list(buffers.staging.numpy())
        self._step_stats = buffers.step_stats.numpy()
        # Per ring slot, the log-probabilities a step leaves there, for each token position of a
        # step (more than one with speculative decoding).
        self._slot_logprobs = []
        for slot in range(buffers.slots):
            first = SlotLogprobs(*(getattr(buffers, name)[slot].numpy() for name in (
                "logprobs", "logprob_ids", "prompt_logprobs", "prompt_logprob_ids")))
            self._slot_logprobs.append([first] + [
                SlotLogprobs(buffers.spec_logprobs[slot, :, j].numpy(), buffers.spec_logprob_ids[slot, :, j].numpy(),
                             first.prompt_logprobs, first.prompt_logprob_ids) for j in range(self.speculation.k)])

    def fail(self, exc: BaseException) -> None:
        """The children are gone or unusable: every live request is lost, and new ones are refused."""
        if self.error is None:
            self.error = exc
        self._children, self._buffers, self._doorbell = [], None, None
        self._relaunch = None
        self.restarting = False
        self._sampled, self._staging, self._step_stats = [], [], None
        self._slot_logprobs = []
        self._inflight.clear()
        self._signal()  # a loop thread asleep on the inbox must see it

    def request_stop(self) -> None:
        """Shutdown: a wait on the children (a step, a restart's start-up) gives up at its next
        liveness poll, and no restart begins."""
        self.stopping.set()
        self._signal()

    @property
    def healthy(self) -> bool:
        """Serving: not stopped by a failure, and not restarting children that wait on another node
        (a local restart takes seconds at most: requests queue through it, and /health stays 200)."""
        return self.error is None and not (self.restarting and self.restart_waits_on_nodes)

    @property
    def unavailable_reason(self) -> str | None:
        """Why the engine does not serve now (what a refused request's 503 says), or None."""
        if self.error is not None:
            return f"the engine stopped: {self.error}"
        if self.restarting and self.restart_waits_on_nodes:
            return "its chip-children restart and wait for another node"
        return None

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine stopped: {self.error}")

    @property
    def requests(self) -> dict[str, RequestState]:
        """Every request the loop took in and that has not finished."""
        return self.output_processor.requests

    # -- requests (any thread) ---------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, where: str = "prompt") -> RequestState:
        """Validates and queues a request; it joins the batch at the next step with room. Raises
        ValueError/TypeError naming the field (nothing is queued then), EngineDeadError after a failure."""
        state = self.make_request(prompt, params, request_id, stream, where)
        self.submit(state)
        return state

    def make_request(self, prompt, params: SamplingParams | None, request_id: str | None, stream: bool,
                     where: str, arrival: float | None = None, lora_request=None) -> RequestState:
        """A validated request, not queued yet (generate() checks every prompt before queueing any)."""
        if self.error is not None:
            raise self.dead_error()
        if params is not None and getattr(params, "priority", 0) and self.scheduling_policy != "priority":
            raise ValueError(f"priority={params.priority}: request priorities need scheduling_policy='priority' "
                             "(--scheduling-policy priority)")
        lora = registration(self.loras, lora_request)  # ValueError: LoRA off, or the adapter is refused
        return self.input_processor.process(prompt, params, request_id, stream, where, arrival, lora)

    def submit(self, state: RequestState) -> None:
        """Queues a request made by make_request. Raises if its id is taken by a live request."""
        if self.error is not None:
            raise self.dead_error()
        if self.refusal is not None:
            raise EngineAsleepError(self.refusal)
        limit = self.max_waiting_requests
        if limit is not None and num_queued(self.scheduler, self._inbox) >= limit:
            raise EngineBusyError(f"{limit} requests are waiting already (max_waiting_requests); try again later")
        with self._ids_lock:
            if state.request_id in self._live_ids:
                raise ValueError(f"request_id {state.request_id!r} is already in use by a running request")
            self._live_ids.add(state.request_id)
        self._inbox.append(("add", state))
        self._signal()

    def abort(self, request_id: str) -> None:
        """Ends the request with finish_reason "abort": its rows and pages are free within
        pipeline_depth steps. An unknown or finished id is ignored."""
        self._inbox.append(("abort", request_id))
        self._signal()

    @property
    def halted(self) -> bool:
        """No step is sent: paused, or asleep (requests that came in wait)."""
        return self.paused or self.refusal is not None

    def call_between_steps(self, fn: Callable[[], object]) -> object:
        """Runs `fn` between two steps, with no command in flight, and returns what it returns:
        on the loop thread when one drives the engine (this thread waits), else here."""
        if not self.driven_by_loop_thread:
            self._drain(self._held)
            return fn()
        call = BetweenSteps(fn)
        self._inbox.append(("call", call))
        self._signal()
        return call.result(lambda: self.dead_error() if self.error is not None else
                           EngineDeadError("the engine is stopping") if self.stopping.is_set() else None)

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or bool(self.requests) or bool(self._inflight)

    def _signal(self) -> None:
        self._work.set()
        self.on_work()

    wake = _signal  # wakes a loop thread asleep in wait_for_work (to stop it), or tells an event loop

    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Sleeps until a request or an abort arrives (an idle engine uses no CPU)."""
        got = self._work.wait(timeout_s)
        self._work.clear()
        return got

    def watch(self) -> list[RequestOutput]:
        """Between steps (an idle loop calls it every fraction of a second): a child that died
        is handled as a failed step would be. Returns the outputs that produced (requests failed
        alone); raises as step() does once the engine stops."""
        if self.error is not None:
            raise self.dead_error()
        outputs: list[RequestOutput] = []
        try:
            for child in self._children:
                child.check_alive("its next command (idle)")
        except ChildFailure as exc:
            self._recover(exc, outputs)
        self._forget_finished(outputs)
        return outputs

    # -- the loop ----------------------------------------------------------------------------------
    def step(self, wait: bool = True) -> list[RequestOutput]:
        """One iteration: apply queued adds and aborts, top up the commands in flight, complete the
        oldest, and return the outputs it produced (deltas of streaming requests, final outputs).
        wait=False (an event loop's driver): completes it only once step_ready(), never sleeps, and
        leaves a control (it drains the steps in flight) to a call that may wait."""
        if self.error is not None:
            raise self.dead_error()
        outputs, self._held = self._held, []
        try:
            self._apply_inbox(outputs, wait)
            for state in self._gate.release():
                self._enqueue(state, outputs)
            sched = self.scheduler
            while not self.halted and len(self._inflight) < self.pipeline_depth and \
                    (s := sched.next_command()) is not None:
                self._inflight.append(self._send(s))
            self._count_scheduling()
            if self._inflight and (wait or self.step_ready()):
                self._complete_oldest(outputs)
            elif wait and (self._gate and sched.idle or self.halted and not outputs):
                self.wait_for_work(0.1)  # nothing runs: until a grammar compiles, a resume, a request or an abort
        except ChildFailure as exc:
            self._recover(exc, outputs)
        except BaseException as exc:
            # The children may hold commands the parent no longer tracks: nothing can go on.
            self.fail(exc)
            raise
        self._forget_finished(outputs)
        if self.kv_events is not None:
            self.kv_events.publish_pool(self.scheduler.pages)
        return outputs

    def close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _recover(self, cause: ChildFailure, outputs: list[RequestOutput]) -> None:
        """Replaces the children after `cause` and resumes every live request as a preempted one;
        past the restart budget, while stopping, or without `relaunch`, stops the engine and
        raises `cause`. Requests still suspects of the failure before end here, alone (recovery.blame)."""
        try:
            self._inflight.clear()  # their tokens are lost with the children: the epochs drop late ones
            # A lost step gives each row at most k + 1 tokens; the last of them must be passed.
            slack = self.pipeline_depth * (self.scheduler.k + 1) + 1
            for state in blame(self.requests.values(), slack):
                state.error = (f"the request was running at {state.failures} consecutive chip-child failures, "
                               f"the last: {cause}")
                for seq in state.seqs:
                    self.scheduler.finish(seq, "abort")
                self.output_processor.report(state, outputs)
                log.error("request %s failed alone: %s", state.request_id, state.error.splitlines()[0])
            self._count_scheduling()
            self.scheduler.requeue([seq for state in self.requests.values() for seq in state.seqs])
            if self.kv_events is not None:  # the new children's cache is empty
                self.scheduler.pages.events = [("cleared",)]
            self._counted = (0, 0, self.scheduler.num_preemptions)  # a new pool counts from 0
            while True:
                if self._relaunch is None or self.stopping.is_set() or not self.restarts.take():
                    raise cause
                self.restarting = True
                self.metrics.engine_restarts.inc()
                log.warning("chip-child failure, restarting the children (%s, %d requests to resume): %s",
                            self.restarts.describe(), len(self.requests), str(cause).splitlines()[0])
                try:
                    self._children, self._doorbell = self._relaunch()
                    break
                except ChildFailure as exc:
                    cause = exc
            # The new children have completed nothing: steps go on from the scheduler's count.
            self._doorbell.word[:] = (self.scheduler.step, -1, 0)
            self.restarting = False
        except BaseException as exc:
            self.fail(exc)
            raise

    def step_ready(self) -> bool:
        """The step that completing the oldest waits for has completed: step(wait=False) takes it."""
        n, inflight = self.output_processor.stream_interval, self._inflight
        return bool(inflight) and self._doorbell.done(inflight[n - 1 if self._grouped(n) else 0].scheduled.command.step)

    @property
    def wake_fd(self) -> int | None:
        """The eventfd the leader child writes after each step (None without one, or children)."""
        return self._doorbell.wake_fd if self._doorbell is not None else None

    @property
    def control_pending(self) -> bool:
        """A call_between_steps waits for a step(wait=True) to run it."""
        return any(kind == "call" for kind, _ in list(self._inbox))

    def _apply_inbox(self, outputs: list[RequestOutput], wait: bool = True) -> None:
        while self._inbox:
            if not wait and self._inbox[0][0] == "call":
                return
            kind, item = self._inbox.popleft()
            if kind == "call":
                self._drain(outputs)
                item.run()
                continue
            if kind == "add":
                self.output_processor.add(item)
                if not self._gate.hold(item):
                    self._enqueue(item, outputs)
                continue
            state = self.requests.get(item)
            if state is None or state.finished:
                continue
            for seq in state.seqs:
                self.scheduler.finish(seq, "abort")
            self.output_processor.report(state, outputs)

    def _drain(self, outputs: list[RequestOutput]) -> None:
        """Completes every command in flight (a control needs the children idle)."""
        while self._inflight:
            self._complete(self._inflight.popleft(), outputs)

    def _enqueue(self, state: RequestState, outputs: list[RequestOutput]) -> None:
        """A request joins the scheduler's queue, with its samples' grammars when it has one."""
        if state.grammar is not None and (error := attach_matchers(state)) is not None:
            for seq in state.seqs:  # what the tokenizer cannot serve: nothing to run
                self.scheduler.finish(seq, "abort", error)
            self.output_processor.report(state, outputs)
            return
        self.scheduler.add(state.seqs)

    def _send(self, s: Scheduled) -> _InFlight:
        staging = self._staging[s.command.step % len(self._staging)]
        for offset, ids in s.staging_tokens:
            staging[offset:offset + len(ids)] = ids
        payload = protocol.encode(s.command)
        copies = self.scheduler.pages.take_copies()  # the host tier's, made while scheduling it
        loads, self.scheduler.lora_loads = self.scheduler.lora_loads, []  # adapters its admits need in their slots
        for child in self._children:
            for slot, path in loads:
                child.send(protocol.encode(protocol.LoraLoad(slot, path)), self.step_timeout_s, self.stopping)
            if copies is not None:
                child.send(protocol.encode(protocol.Copies(copies)), self.step_timeout_s, self.stopping)
            child.send(payload, self.step_timeout_s, self.stopping)
        return _InFlight(s, len(payload))

    def _complete_oldest(self, outputs: list[RequestOutput]) -> None:
        """Completes the oldest step in flight; with stream_interval N > 1, N decode steps after one
        wait, each request's tokens in one delta: parent, API server and client wake once for N
        tokens (each wake-up preempts the child's threads on a machine they fill)."""
        n, inflight = self.output_processor.stream_interval, self._inflight
        if not self._grouped(n):
            return self._complete(inflight.popleft(), outputs)  # a step with prompt chunks: first tokens at once
        self._doorbell.wait(inflight[n - 1].scheduled.command.step, self.step_timeout_s,
                            queued_behind=len(inflight) > n)
        touched: dict[str, RequestState] = {}
        for _ in range(n):
            self._complete(inflight.popleft(), outputs, touched)
        for state in touched.values():
            self.output_processor.report(state, outputs)

    def _grouped(self, n: int) -> bool:
        """N decode steps in flight are read together (stream_interval N > 1, no prompt chunks)."""
        inflight = self._inflight
        return n > 1 and len(inflight) >= n and not any(inflight[i].scheduled.command.chunks for i in range(n))

    def _complete(self, entry: _InFlight, outputs: list[RequestOutput],
                  touched: dict[str, RequestState] | None = None) -> None:
        step = entry.scheduled.command.step
        t_wait = time.perf_counter()
        self._doorbell.wait(step, self.step_timeout_s, queued_behind=bool(self._inflight))
        now = time.perf_counter()
        slot = step % len(self._sampled)
        if (buffers := self._buffers).spec_counts is None:
            advanced = self.scheduler.on_tokens(entry.scheduled.producers, self._sampled[slot], now)
            self.output_processor.process(advanced, now, outputs, self._slot_logprobs[slot][0],
                                          entry.scheduled.prompt_logprobs, touched)
        else:
            take_speculative_step(self.speculation, self.scheduler, entry.scheduled.producers,
                                  buffers.spec_counts[slot].numpy(), buffers.spec_ids[slot].numpy(), now,
                                  lambda advanced, j: self.output_processor.process(
                                      advanced, now, outputs, self._slot_logprobs[slot][j],
                                      entry.scheduled.prompt_logprobs if j == 0 else (), touched))
        self._time(entry, slot, now, t_wait)
        self._last_done = now

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """The ids of finished requests may be used again."""
        with self._ids_lock:
            for out in outputs:
                if out.finished:
                    self._live_ids.discard(out.request_id)

    def _time(self, entry: _InFlight, slot: int, now: float, t_wait: float) -> None:
        """Feeds the step's child time to the prefill cap (l3worker/engine/step_timing.py), and
        records the step for generate()'s figures or a step trace."""
        stats, cmd = self._step_stats[slot].tolist(), entry.scheduled.command
        prompt_tokens = sum(c.length for c in cmd.chunks)
        decode_rows = len(entry.scheduled.producers) - sum(c.last for c in cmd.chunks)
        self.step_timing.observe(stats[1] / 1e6, prompt_tokens, decode_rows)
        # Served (a server's loop thread drives it): prompt chunks bounded by time. Offline, the schedule
        # stays a function of the requests alone (reproducible runs and counters).
        self.scheduler.prefill_cap = self.step_timing.prefill_cap() if self.driven_by_loop_thread else None
        if (recorder := self.output_processor.recorder) is not None:
            recorder.steps.append(StepRecord.of(cmd.step, cmd.is_prefill, stats, now - self._last_done,
                                                now - t_wait, entry.command_bytes, prompt_tokens,
                                                len(entry.scheduled.producers), self.scheduler.num_preemptions))

    def _count_scheduling(self) -> None:
        """Moves the scheduler's prefix-cache and preemption counts into the metrics."""
        pool = self.scheduler.pages
        now = (pool.queries_tokens, pool.hits_tokens, self.scheduler.num_preemptions)
        if now != self._counted:
            m = self.metrics
            for counter, new, old in zip((m.prefix_cache_queries, m.prefix_cache_hits, m.preemptions), now,
                                         self._counted):
                counter.inc(new - old)
            self._counted = now

