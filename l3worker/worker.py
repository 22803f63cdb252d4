"""DistributedWorker: the L3 parent. Holds the prepared runtime and never opens a device.

prepare() makes the shared step buffers and starts one chip-child per device; generate() admits
requests into batch rows, keeps up to `pipeline_depth` diff-only step commands in flight, and
reads sampled ids from the shared ring; close() stops the children and removes the socket files.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import zmq

from chip_child import protocol
from chip_child.device import DEVICE_TYPES, CorePlan, available_cores, device_type, pin_socket_threads, plan_cores
from chip_child.loader import load_config, load_tokenizer, resolve_dtype
from chip_child.model import shard_config
from chip_child.runtime import COPY_POLICIES, RuntimeConfig
from chip_child.tiny_model import ensure_tiny_model
from l3worker.child import ChildProcess
from l3worker.doorbell import ORDERED_STORES, Doorbell
from l3worker.errors import WorkerError
from l3worker.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from l3worker.scheduler import Request, Scheduled, Scheduler
from l3worker.shared import StepBuffers
from l3worker.stats import GenerateStats, StepRecord

Prompt = str | Sequence[int] | np.ndarray
MAX_SPIN_S = 0.1  # a spinning parent checks nothing else, so failures surface at most this late


@dataclass
class _InFlight:
    scheduled: Scheduled
    command_bytes: int


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class DistributedWorker:
    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        device_ids: Sequence[int] = (0,),
        device: str = "auto",
        max_batch_size: int = 16,
        max_seq_len: int = 4096,
        page_size: int = 128,
        num_pages: int | None = None,
        dtype: str = "auto",
        pipeline_depth: int = 2,
        copy_policy: str = "dirty",
        step_timeout_s: float | None = 300.0,
        startup_timeout_s: float | None = 600.0,
        num_threads: int | None = None,
        spin_wait_s: float = 0.003,
        pin_cores: bool = True,
        fault_injection: str | None = None,  # test-only, see chip_child.serve
    ):
        if device not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {DEVICE_TYPES}, got {device!r}")
        if not isinstance(dtype, str):
            raise TypeError(f"dtype must be a name such as 'auto', 'bfloat16' or 'float32', got {dtype!r}")
        if copy_policy not in COPY_POLICIES:
            raise ValueError(f"copy_policy must be one of {COPY_POLICIES}, got {copy_policy!r}")
        device_ids = tuple(device_ids)
        if not device_ids:
            raise ValueError("device_ids must name at least one device")
        for d in device_ids:
            _positive_int("device_ids entry", d, 0)
        if len(set(device_ids)) != len(device_ids) and device != "cpu":
            raise ValueError(f"device_ids must not repeat a device, got {device_ids}")
        _positive_int("max_batch_size", max_batch_size)
        _positive_int("max_seq_len", max_seq_len, 2)
        _positive_int("page_size", page_size)
        _positive_int("pipeline_depth", pipeline_depth)
        if num_pages is not None:
            _positive_int("num_pages", num_pages)
        if num_threads is not None:
            _positive_int("num_threads", num_threads)
        if not isinstance(pin_cores, bool):
            raise TypeError(f"pin_cores must be a bool, got {type(pin_cores).__name__}")
        if not 0 <= spin_wait_s <= MAX_SPIN_S:
            raise ValueError(f"spin_wait_s must be in [0, {MAX_SPIN_S}] seconds, got {spin_wait_s}")
        for name, value in (("step_timeout_s", step_timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds or None, got {value}")
        self.model_dir = str(model_dir) if model_dir is not None else str(ensure_tiny_model())
        self.model_config = load_config(self.model_dir)
        resolve_dtype(dtype, "cpu", self.model_config)  # rejects unknown names before any child starts
        if max_seq_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{self.model_config.max_position_embeddings}")
        shard_config(self.model_config, len(device_ids))  # tensor parallelism must divide heads and MLP
        self.tokenizer = load_tokenizer(self.model_dir)
        self.runtime_config = RuntimeConfig(
            model_dir=self.model_dir, device=device, device_id=device_ids[0], dtype=dtype,
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, page_size=page_size, num_pages=num_pages,
            copy_policy=copy_policy, num_threads=num_threads,
        )
        self.device_ids = device_ids
        self.pipeline_depth = pipeline_depth
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.spin_wait_s = spin_wait_s  # how long the parent spins on the doorbell before it sleeps
        self.pin_cores = pin_cores
        self._doorbell: Doorbell | None = None
        self._core_plan: CorePlan | None = None
        self._fault = fault_injection
        self._children: list[ChildProcess] = []
        self._ctx: zmq.Context | None = None
        self._socket_dir: str | None = None
        self._buffers: StepBuffers | None = None
        self._scheduler: Scheduler | None = None
        self._state = "new"  # new -> ready -> closed
        self._prepare_s = 0.0
        self._next_request_id = 0
        self._requests_served = 0
        self._generate_calls = 0
        self._last = GenerateStats()

    # -- lifecycle -------------------------------------------------------------------------------
    def prepare(self) -> "DistributedWorker":
        """Starts the chip-children and waits until each has loaded weights, allocated and warmed
        up. Idempotent."""
        if self._state == "ready":
            return self
        if self._state == "closed":
            raise WorkerError("this worker was closed; make a new DistributedWorker")
        t0 = time.perf_counter()
        cfg = self.runtime_config
        try:
            self._buffers = StepBuffers.create(self.pipeline_depth + 1, cfg.max_batch_size, cfg.prefill_capacity)
            self._socket_dir = tempfile.mkdtemp(prefix="l3worker-")
            self._ctx = zmq.Context()
            self._state = "ready"  # from here on close() has something to release
            world = len(self.device_ids)
            self._core_plan = plan = self._plan_cores(world)
            _live_workers.add(self)
            if plan:
                pin_socket_threads(self._ctx, plan.service)  # before the first socket starts its threads
            wake_every_step = not ORDERED_STORES
            for rank, device_id in enumerate(self.device_ids):
                rc = replace(cfg, device_id=device_id, tp_rank=rank, tp_size=world,
                             dist_init=f"file://{self._socket_dir}/tp-store" if world > 1 else None)
                if plan and cfg.num_threads is None:
                    # The child's own default would count only the cores it is pinned to.
                    rc = replace(rc, num_threads=len(plan.children[rank]))
                self._children.append(ChildProcess(self._ctx, rank, rc, self._buffers, self._socket_dir,
                                                   wake_every_step, self._fault,
                                                   plan.children[rank] if plan else None,
                                                   plan.service if plan else None))
            for child in self._children:
                child.wait_ready(self.startup_timeout_s)
            self._doorbell = Doorbell(self._buffers.doorbell.numpy(), self._children, self._spin_budget())
        except BaseException:
            self.close()
            raise
        self._scheduler = Scheduler(
            max_batch_size=cfg.max_batch_size, page_size=cfg.page_size, max_blocks_per_row=cfg.max_blocks_per_row,
            num_pages=cfg.total_pages - 1, prefill_capacity=cfg.prefill_capacity,
            full_state=cfg.copy_policy == "always",
        )
        self._prepare_s = time.perf_counter() - t0
        return self

    def _plan_cores(self, children: int) -> CorePlan | None:
        """Cores for cpu children only, and not when another worker of this process already
        pinned its children: both would pick the same cores."""
        if not self.pin_cores or device_type(self.runtime_config.device) != "cpu":
            return None
        if any(w._core_plan for w in _live_workers if w is not self):
            return None
        return plan_cores(children, self.runtime_config.num_threads)

    def _spin_budget(self) -> float:
        """Spin only where a core is free for it: on accelerators, or when the cpu children's
        threads leave one. A spinning parent inside a child's OpenMP team slows every step."""
        info = self._children[0].info
        if info.get("device") == "cpu":
            cores = available_cores()
            if info.get("threads", cores) * len(self._children) >= cores:
                return 0.0
        return self.spin_wait_s

    def close(self) -> None:
        """Stops every child and removes the socket directory. Idempotent; safe after failures."""
        children, self._children = self._children, []
        for child in children:
            child.stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # also closes a socket whose child never started
            self._ctx = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        self._buffers = None
        self._doorbell = None
        self._core_plan = None  # its cores are free for another worker
        self._state = "closed"

    def __enter__(self) -> "DistributedWorker":
        return self.prepare()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_children", None):
            self.close()

    @property
    def child_pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def socket_dir(self) -> str | None:
        return self._socket_dir

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; more prompts than rows queue and enter as rows free up.
        Bad input raises before anything reaches a child and leaves the worker usable."""
        t0 = time.perf_counter()
        if self._state == "closed":
            raise WorkerError("this worker was closed; make a new DistributedWorker")
        requests = self._make_requests(prompts, params, t0)
        self.prepare()
        stats = GenerateStats(setup_s=time.perf_counter() - t0, requests=len(requests))
        self._last = stats
        self._generate_calls += 1
        try:
            self._run(requests, stats)
        except BaseException:
            # Children may hold commands the parent no longer tracks (Ctrl-C, a child error or
            # death): the only safe state is none at all.
            self.close()
            raise
        stats.wall_s = time.perf_counter() - t0
        self._requests_served += len(requests)
        return [self._output(r) for r in requests]

    def _run(self, requests: list[Request], stats: GenerateStats) -> None:
        sched = self._scheduler
        sched.add(requests)
        inflight: deque[_InFlight] = deque()
        last_done = time.perf_counter()
        while True:
            while len(inflight) < self.pipeline_depth and (s := sched.next_command()) is not None:
                inflight.append(self._send(s))
            if not inflight:
                break
            entry = inflight.popleft()
            step = entry.scheduled.command.step
            t_wait = time.perf_counter()
            self._doorbell.wait(step, self.step_timeout_s, queued_behind=bool(inflight))
            now = time.perf_counter()
            slot = step % self._buffers.slots
            ids = self._buffers.sampled[slot].numpy()
            apply_us, device_us, h2d_copies, h2d_bytes, pool_allocs = self._buffers.step_stats[slot].tolist()
            for req in sched.on_tokens(entry.scheduled.producers, ids, now):
                stats.generated_tokens += len(req.tokens)
            stats.steps.append(StepRecord(
                step=step, prefill=entry.scheduled.command.is_prefill, parent_wall_s=now - last_done,
                wait_s=now - t_wait, apply_s=apply_us / 1e6, device_s=device_us / 1e6,
                command_bytes=entry.command_bytes, h2d_copies=h2d_copies, h2d_bytes=h2d_bytes,
                pool_allocs=pool_allocs,
            ))
            last_done = now
        for req in requests:
            stats.ttft_s.append(req.first_token_at - req.arrival)
            if len(req.tokens) > 1:
                stats.tpot_s.append((req.last_token_at - req.first_token_at) / (len(req.tokens) - 1))

    def _send(self, s: Scheduled) -> _InFlight:
        staging = self._buffers.staging[s.command.step % self._buffers.slots].numpy()
        for offset, ids in s.staging_tokens:
            staging[offset:offset + len(ids)] = ids
        payload = protocol.encode(s.command)
        for child in self._children:
            child.send(payload)
        return _InFlight(s, len(payload))

    # -- input ---------------------------------------------------------------------------------
    def _make_requests(self, prompts, params, now: float) -> list[Request]:
        prompt_list = self._as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"params: {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        vocab = self.model_config.vocab_size
        cfg = self.runtime_config
        requests = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
            p.validate(vocab)
            ids = self._token_ids(prompt, i)
            if len(ids) + p.max_new_tokens > cfg.max_seq_len:
                raise ValueError(f"prompts[{i}]: prompt length {len(ids)} + max_new_tokens {p.max_new_tokens} "
                                 f"exceeds max_seq_len={cfg.max_seq_len}")
            req = Request(
                request_id=self._next_request_id + i, prompt=prompt if isinstance(prompt, str) else None,
                prompt_ids=ids, params=p, seed=p.seed if p.seed is not None else secrets.randbits(63),
                stop_ids=frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else
                                                        frozenset(self.model_config.eos_token_ids)),
                arrival=now,
            )
            if req.pages_needed(cfg.page_size) > cfg.total_pages - 1:
                raise ValueError(f"prompts[{i}] needs {req.pages_needed(cfg.page_size)} KV pages, more than "
                                 f"num_pages={cfg.total_pages - 1}")
            requests.append(req)
        self._next_request_id += len(requests)
        return requests

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, (str, np.ndarray)) or _is_tensor(prompts):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of ints, an int array or a list of those, "
                            f"got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts: empty list")
        if all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return list(prompts)

    def _token_ids(self, prompt, i: int) -> np.ndarray:
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text but {self.model_dir} has no tokenizer.json; pass token ids")
            ids = np.asarray(self.tokenizer.encode(prompt, add_special_tokens=False).ids, dtype=np.int64)
        else:
            if _is_tensor(prompt):
                prompt = prompt.detach().cpu().numpy()
            if isinstance(prompt, np.ndarray):
                if not np.issubdtype(prompt.dtype, np.integer):
                    raise TypeError(f"prompts[{i}]: token array must have an integer dtype, got {prompt.dtype}")
                if prompt.ndim != 1:
                    raise ValueError(f"prompts[{i}]: token array must be 1-D, got shape {prompt.shape}")
                ids = prompt
            elif isinstance(prompt, (list, tuple)):
                if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                    raise TypeError(f"prompts[{i}]: token ids must be ints")
                try:
                    ids = np.asarray(prompt, dtype=np.int64)
                except OverflowError:
                    raise ValueError(f"prompts[{i}]: token id outside [0, {vocab}) (vocab_size)") from None
            else:
                raise TypeError(f"prompts[{i}]: unsupported prompt type {type(prompt).__name__}")
        if ids.size == 0:
            raise ValueError(f"prompts[{i}]: empty prompt")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompts[{i}]: token id {bad} outside [0, {vocab}) (vocab_size)")
        return ids.astype(np.int32)

    def _output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=True)
        n = len(req.tokens)
        decode_s = req.last_token_at - req.first_token_at
        metrics = RequestMetrics(
            ttft_s=req.first_token_at - req.arrival, decode_s=decode_s,
            tpot_s=decode_s / (n - 1) if n > 1 else 0.0, queued_s=req.admitted_at - req.arrival,
        )
        sample = CompletionOutput(0, list(req.tokens), text, finish_reason=req.finish_reason)
        return RequestOutput(str(req.request_id), req.prompt, req.prompt_ids.tolist(), [sample], finished=True,
                             metrics=metrics)

    # -- figures -------------------------------------------------------------------------------
    def stats(self) -> dict:
        info = self._children[0].info if self._children else {}
        return {
            "state": self._state,
            "device": info.get("device"),
            "dtype": info.get("dtype"),
            "child_pids": self.child_pids,
            "child_setup_s": info.get("setup_s"),
            "child_threads": info.get("threads"),
            "child_cores": info.get("cores"),
            "prepare_s": self._prepare_s,
            "pipeline_depth": self.pipeline_depth,
            "copy_policy": self.runtime_config.copy_policy,
            "kv_pages_total": self.runtime_config.total_pages - 1,
            "kv_pages_free": self._scheduler.pages.num_free if self._scheduler else None,
            "generate_calls": self._generate_calls,
            "requests_served": self._requests_served,
            "last_generate": self._last.summary(),
        }

    def step_records(self) -> list[dict]:
        """Every step of the last generate() call, for --profile."""
        return self._last.step_table()


def _is_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


_live_workers: "weakref.WeakSet[DistributedWorker]" = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    """A program that forgets close() still stops its children on a normal exit."""
    for worker in list(_live_workers):
        worker.close()
