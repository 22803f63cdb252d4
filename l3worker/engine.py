"""The one step loop every caller shares: generate(), stream(), and the HTTP server.

`Engine.add_request` and `Engine.abort` may be called from any thread at any moment; they only
queue the change, which the loop applies at the start of its next step. `Engine.step` keeps up to
`pipeline_depth` commands in flight, reads one step's sampled ids from the shared ring, and turns
them into outputs: detokenized incrementally, stop strings matched, deltas for streaming
requests, one final output per request. One thread at a time drives `step`: the caller's
(DistributedWorker.generate / stream) or an AsyncEngine's loop thread (see async_engine.py).
"""
from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from chip_child import protocol
from chip_child.config import RuntimeConfig
from chip_child.loader import ModelConfig
from l3worker.child import ChildProcess
from l3worker.detokenizer import SampleText
from l3worker.doorbell import Doorbell
from l3worker.errors import WorkerError
from l3worker.inputs import token_ids
from l3worker.metrics import EngineMetrics
from l3worker.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprob
from l3worker.scheduler import Scheduled, Scheduler, Sequence
from l3worker.shared import StepBuffers
from l3worker.stats import GenerateStats, StepRecord


class EngineDeadError(WorkerError):
    """The engine stopped after a failure (a chip-child died, raised or hung); it takes no requests."""


@dataclass
class _InFlight:
    scheduled: Scheduled
    command_bytes: int


@dataclass
class RequestState:
    """A request inside the engine: its samples, their text, and what was already reported."""

    request_id: str
    prompt: str | None
    prompt_ids: np.ndarray
    params: SamplingParams
    stream: bool  # report deltas every step, not only the final output
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)
    texts: list[SampleText | None] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None  # per sample
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reported: list[int] = field(default_factory=list)  # per sample: tokens already in a delta
    first_token_seen: bool = False
    finished: bool = False

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """Built once: every output of the request shares this list."""
        return self.prompt_ids.tolist()

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class Engine:
    def __init__(self, model_config: ModelConfig, runtime_config: RuntimeConfig, tokenizer, model_dir: str,
                 pipeline_depth: int, step_timeout_s: float | None, max_num_batched_tokens: int,
                 enable_prefix_caching: bool):
        self.model_config = model_config
        self.runtime_config = runtime_config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.pipeline_depth = pipeline_depth
        self.step_timeout_s = step_timeout_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, RequestState] = {}
        self.metrics = EngineMetrics(running=self._num_running, waiting=self._num_waiting, kv_usage=self._kv_usage)
        self.recorder: GenerateStats | None = None  # generate() collects per-step figures here
        self.error: BaseException | None = None
        self.driven_by_loop_thread = False  # an AsyncEngine owns step()
        self._children: list[ChildProcess] = []
        self._buffers: StepBuffers | None = None
        self._doorbell: Doorbell | None = None
        self._inflight: deque[_InFlight] = deque()
        self._inbox: deque[tuple[str, object]] = deque()  # ("add", RequestState) / ("abort", request_id)
        self._work = threading.Event()  # set whenever the inbox gets something
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._last_done = time.perf_counter()
        self._live_ids: set[str] = set()
        self._ids_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self, children: list[ChildProcess], buffers: StepBuffers, doorbell: Doorbell) -> None:
        """Attaches the started children; requests queued before this are admitted at the first step."""
        cfg = self.runtime_config
        self._children, self._buffers, self._doorbell = children, buffers, doorbell
        self.scheduler = Scheduler(
            max_batch_size=cfg.max_batch_size, page_size=cfg.page_size, max_blocks_per_row=cfg.max_blocks_per_row,
            num_pages=cfg.total_pages - 1, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching, full_state=cfg.copy_policy == "always",
        )
        self._counted = (0, 0, 0)  # prefix cache queries and hits, preemptions: already in the metrics
        self._inflight.clear()

    def fail(self, exc: BaseException) -> None:
        """The children are gone or unusable: every live request is lost, and new ones are refused."""
        if self.error is None:
            self.error = exc
        self._children, self._buffers, self._doorbell = [], None, None
        self._inflight.clear()
        self._work.set()  # a loop thread asleep on the inbox must see it

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine stopped: {self.error}")

    # -- requests (any thread) ---------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, where: str = "prompt") -> RequestState:
        """Validates and queues a request; it joins the batch at the next step with room. Raises
        ValueError/TypeError naming the field (nothing is queued then), EngineDeadError after a failure."""
        state = self.make_request(prompt, params, request_id, stream, where)
        self.submit(state)
        return state

    def make_request(self, prompt, params: SamplingParams | None, request_id: str | None, stream: bool,
                     where: str, arrival: float | None = None) -> RequestState:
        """A validated request, not queued yet (generate() checks every prompt before queueing any)."""
        if self.error is not None:
            raise self.dead_error()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: stop strings need a tokenizer, and {self.model_dir} has no tokenizer.json")
        ids = token_ids(prompt, self.tokenizer, self.model_config.vocab_size, where, self.model_dir)
        cfg = self.runtime_config
        steps = max(params.max_new_tokens, 1)
        if len(ids) + steps > cfg.max_seq_len:
            raise ValueError(f"{where}: prompt length {len(ids)} + max_new_tokens {params.max_new_tokens} "
                             f"exceeds max_seq_len={cfg.max_seq_len}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        now = time.perf_counter() if arrival is None else arrival
        state = RequestState(request_id or "", prompt if isinstance(prompt, str) else None, ids, params, stream, now)
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        stop_ids = frozenset(params.stop_token_ids) | eos
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), i, ids, params, (base_seed + i) % 2**63, stop_ids, arrival=now,
                           want_prompt_logprobs=i == 0 and params.prompt_logprobs is not None)
            if seq.pages_needed(cfg.page_size) > cfg.total_pages - 1:
                raise ValueError(f"{where} needs {seq.pages_needed(cfg.page_size)} KV pages, more than "
                                 f"num_pages={cfg.total_pages - 1}")
            state.seqs.append(seq)
            state.texts.append(SampleText(self.tokenizer, params.skip_special_tokens, params.stop,
                                          params.include_stop_str_in_output)
                               if self.tokenizer is not None and (stream or params.stop) else None)
        state.reported = [0] * params.n
        if params.logprobs is not None:
            state.logprobs = [[] for _ in range(params.n)]
        state.request_id = str(next(self._ids)) if request_id is None else request_id
        for seq in state.seqs:
            seq.request_id = state.request_id
        return state

    def submit(self, state: RequestState) -> None:
        """Queues a request made by make_request. Raises if its id is taken by a live request."""
        if self.error is not None:
            raise self.dead_error()
        with self._ids_lock:
            if state.request_id in self._live_ids:
                raise ValueError(f"request_id {state.request_id!r} is already in use by a running request")
            self._live_ids.add(state.request_id)
        self._inbox.append(("add", state))
        self._work.set()

    def abort(self, request_id: str) -> None:
        """Ends the request with finish_reason "abort": its rows and pages are free within
        pipeline_depth steps. An unknown or finished id is ignored."""
        self._inbox.append(("abort", request_id))
        self._work.set()

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or bool(self.requests) or bool(self._inflight)

    def wake(self) -> None:
        """Wakes a loop thread asleep in wait_for_work (to stop it)."""
        self._work.set()

    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Sleeps until a request or an abort arrives (an idle engine uses no CPU)."""
        got = self._work.wait(timeout_s)
        self._work.clear()
        return got

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: apply queued adds and aborts, top up the commands in flight, complete the
        oldest, and return the outputs it produced (deltas of streaming requests, final outputs)."""
        if self.error is not None:
            raise self.dead_error()
        outputs: list[RequestOutput] = []
        try:
            self._apply_inbox(outputs)
            sched = self.scheduler
            while len(self._inflight) < self.pipeline_depth and (s := sched.next_command()) is not None:
                self._inflight.append(self._send(s))
            self._count_scheduling()
            if self._inflight:
                self._complete(self._inflight.popleft(), outputs)
        except BaseException as exc:
            # The children may hold commands the parent no longer tracks: nothing can go on.
            self.fail(exc)
            raise
        return outputs

    def _apply_inbox(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self.requests[item.request_id] = item
                self.scheduler.add(item.seqs)
                continue
            state = self.requests.get(item)
            if state is None or state.finished:
                continue
            for seq in state.seqs:
                self.scheduler.finish(seq, "abort")
            self._report(state, outputs)

    def _send(self, s: Scheduled) -> _InFlight:
        staging = self._buffers.staging[s.command.step % self._buffers.slots].numpy()
        for offset, ids in s.staging_tokens:
            staging[offset:offset + len(ids)] = ids
        payload = protocol.encode(s.command)
        for child in self._children:
            child.send(payload)
        return _InFlight(s, len(payload))

    def _complete(self, entry: _InFlight, outputs: list[RequestOutput]) -> None:
        step = entry.scheduled.command.step
        t_wait = time.perf_counter()
        self._doorbell.wait(step, self.step_timeout_s, queued_behind=bool(self._inflight))
        now = time.perf_counter()
        buffers = self._buffers
        slot = step % buffers.slots
        advanced = self.scheduler.on_tokens(entry.scheduled.producers, buffers.sampled[slot].numpy(), now)
        if entry.scheduled.prompt_logprobs:
            self._read_prompt_logprobs(entry.scheduled, slot)
        touched: dict[str, RequestState] = {}
        new_tokens = 0
        for row, seq in advanced:
            state = self.requests[seq.request_id]
            touched[state.request_id] = state
            new_tokens += self._on_sample_tokens(state, row, seq, slot, now)
        self.metrics.generation_tokens.inc(new_tokens)
        for state in touched.values():
            self._report(state, outputs)
        if self.recorder is not None:
            self._record(entry, slot, now, t_wait, new_tokens)
        self._last_done = now

    def _on_sample_tokens(self, state: RequestState, row: int, seq: Sequence, slot: int, now: float) -> int:
        """Takes in the token a step gave one sample (in `row`): text, stop strings, logprobs and
        latency figures. Returns the number of tokens it added (0 for a scoring prefill)."""
        if not seq.tokens:  # scoring only: the prefill finished the request
            self._observe_first_token(state, seq, now)
            return 0
        token = seq.tokens[-1]
        if state.logprobs is not None:
            state.logprobs[seq.index].append(self._read_logprobs(slot, row, token, seq.params.logprobs))
        if len(seq.tokens) == 1:
            self._observe_first_token(state, seq, now)
        else:
            self.metrics.itl.observe(now - seq.prev_token_at)
        text = state.texts[seq.index]
        if text is not None:
            hit = text.add(token)
            if hit is not None:
                self.scheduler.finish(seq, "stop", hit)
        return 1

    def _observe_first_token(self, state: RequestState, seq: Sequence, now: float) -> None:
        if state.first_token_seen:
            return
        state.first_token_seen = True
        self.metrics.ttft.observe(now - state.arrival)
        self.metrics.queue_time.observe(seq.admitted_at - state.arrival)
        self.metrics.prompt_tokens.inc(len(state.prompt_ids))

    def _read_logprobs(self, slot: int, row: int, token: int, top_n: int) -> TokenLogprob:
        values = self._buffers.logprobs[slot][row].numpy()
        ids = self._buffers.logprob_ids[slot][row].numpy()
        top = tuple((int(i), float(v)) for i, v in zip(ids[:top_n], values[1:1 + top_n]))
        return TokenLogprob(token, float(values[0]), top)

    def _read_prompt_logprobs(self, scheduled: Scheduled, slot: int) -> None:
        """A chunk's entry at staging offset + i holds the log-probability of the prompt token
        after position start + i, and the top N there."""
        values = self._buffers.prompt_logprobs[slot].numpy()
        ids = self._buffers.prompt_logprob_ids[slot].numpy()
        for offset, start, length, seq in scheduled.prompt_logprobs:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue  # aborted meanwhile
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None] * seq.prompt_len
            top_n = seq.params.prompt_logprobs
            for q in range(start, min(start + length, seq.prompt_len - 1)):
                row = offset + q - start
                state.prompt_logprobs[q + 1] = TokenLogprob(
                    int(seq.prompt_ids[q + 1]), float(values[row, 0]),
                    tuple((int(i), float(v)) for i, v in zip(ids[row, :top_n], values[row, 1:1 + top_n])))

    def _report(self, state: RequestState, outputs: list[RequestOutput]) -> None:
        """Adds the request's delta (streaming) or, once every sample is done, its final output."""
        done = state.all_finished
        if not done and not state.stream:
            return
        samples = []
        for seq in state.seqs:
            i = seq.index
            sent = state.reported[i]
            if not done and len(seq.tokens) == sent and not seq.finished:
                continue
            text = state.texts[i]
            final = seq.finished
            if done and text is None and self.tokenizer is not None:
                text = SampleText(self.tokenizer, seq.params.skip_special_tokens, (), False)
                state.texts[i] = text
            if final and text is not None:
                text.finish(seq.tokens, isinstance(seq.stop_reason, str))
            lps = state.logprobs[i] if state.logprobs is not None else None
            out = CompletionOutput(
                index=i, finish_reason=seq.finish_reason if final else None,
                stop_reason=seq.stop_reason if final else None,
                delta_token_ids=seq.tokens[sent:], delta_text=text.delta(final) if text is not None else "",
                delta_logprobs=lps[sent:] if lps is not None else None,
            )
            if done:
                out.token_ids, out.logprobs = list(seq.tokens), lps
                out.text = text.text if text is not None else None
            state.reported[i] = len(seq.tokens)
            samples.append(out)
        if done:
            state.finished = True
            self._finish_request(state)
        if samples or done:
            outputs.append(RequestOutput(
                state.request_id, state.prompt, state.prompt_token_ids, samples, finished=done,
                prompt_logprobs=state.prompt_logprobs, num_cached_tokens=state.seqs[0].num_cached_tokens,
                metrics=_request_metrics(state) if done else None))

    def _finish_request(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        self._forget(state.request_id)
        reason = state.seqs[0].finish_reason
        self.metrics.request_success.labels(reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - state.arrival)
        if self.recorder is not None:
            for seq in state.seqs:
                if seq.tokens:
                    self.recorder.ttft_s.append(seq.first_token_at - seq.arrival)
                if len(seq.tokens) > 1:
                    self.recorder.tpot_s.append((seq.last_token_at - seq.first_token_at) / (len(seq.tokens) - 1))

    def _forget(self, request_id: str) -> None:
        with self._ids_lock:
            self._live_ids.discard(request_id)

    def _record(self, entry: _InFlight, slot: int, now: float, t_wait: float, new_tokens: int) -> None:
        apply_us, device_us, h2d_copies, h2d_bytes, pool_allocs = self._buffers.step_stats[slot].tolist()
        self.recorder.generated_tokens += new_tokens
        self.recorder.steps.append(StepRecord(
            step=entry.scheduled.command.step, prefill=entry.scheduled.command.is_prefill,
            parent_wall_s=now - self._last_done, wait_s=now - t_wait, apply_s=apply_us / 1e6,
            device_s=device_us / 1e6, command_bytes=entry.command_bytes, h2d_copies=h2d_copies,
            h2d_bytes=h2d_bytes, pool_allocs=pool_allocs,
        ))

    # -- gauges, read by the metrics registry ------------------------------------------------------
    def _num_running(self) -> int:
        return sum(1 for s in self.requests.values() if any(q.row >= 0 and not q.finished for q in s.seqs))

    def _num_waiting(self) -> int:
        return sum(1 for s in self.requests.values() if all(q.row < 0 and not q.finished for q in s.seqs)) + \
            sum(1 for kind, _ in list(self._inbox) if kind == "add")

    def _kv_usage(self) -> float:
        return self.scheduler.pages.usage if self.scheduler is not None else 0.0

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


def _request_metrics(state: RequestState) -> RequestMetrics | None:
    seq = state.seqs[0]
    n = len(seq.tokens)
    if n == 0:
        return RequestMetrics(ttft_s=0.0, decode_s=0.0, tpot_s=0.0, queued_s=max(seq.admitted_at - seq.arrival, 0.0))
    decode_s = seq.last_token_at - seq.first_token_at
    return RequestMetrics(ttft_s=seq.first_token_at - seq.arrival, decode_s=decode_s,
                          tpot_s=decode_s / (n - 1) if n > 1 else 0.0, queued_s=seq.admitted_at - seq.arrival)
