"""DistributedWorker: the L3 parent. Holds the prepared runtime and never opens a device.

prepare() makes the shared step buffers and starts one chip-child per device; generate() and
stream() put requests on the engine's step loop (l3worker/engine/step_loop.py), which keeps up to
`pipeline_depth` diff-only step commands in flight; close() stops the children and removes the
socket files. When a child dies, raises or hangs, the engine has the worker start fresh children
the way prepare() does (`_relaunch`) and resumes every request (see l3worker/engine/recovery.py).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from typing import Iterator, Sequence

import zmq
from tqdm import tqdm

from chip_child.attention import cache_dtype_of, get_backend
from chip_child.config import COPY_POLICIES, DEVICE_TYPES, RuntimeConfig
from chip_child.cpu_layout import step_weight_elements
from chip_child.device import CorePlan, check_optional_bool, default_page_size, device_type, pin_socket_threads
from chip_child.models.fused import resolve_fused_kernels
from chip_child.step.graphs import resolve_decode_graphs
from chip_child.models.loader import load_config, load_tokenizer, resolve_dtype
from chip_child.models.qwen3 import shard_config
from chip_child.models.prepack import resolve_cpu_prepack
from chip_child.spec.config import SpeculativeConfig
from chip_child.models.tiny_model import TINY_MODEL_SERVED_NAME, ensure_tiny_model
from l3worker.worker.child_process import ChildProcess, child_spec, wait_all_ready
from l3worker.worker.worker_stats import worker_stats
from l3worker.worker.lora_controls import LoraControls, lora_info, lora_registry
from l3worker.worker.arg_checks import (SCHEDULING_POLICIES, check_choice, check_kv_cache_dtype, check_limits,
                                        check_speculation_switches, default_pipeline_depth, positive_int)
from l3worker.worker.kv_sizing import KvSizing, host_tier_pages, kv_cache_bytes, size_kv_cache, size_kv_cache_in
from l3worker.worker.cpu_placement import CpuPlacement
from l3worker.worker.early_child import EarlyChild
from l3worker.worker.shared_buffers import StepBuffers
from l3worker.engine.speculation import check_proposer, speculative_tokens
from l3worker.worker.doorbell import ORDERED_STORES, Doorbell, make_wake_fd
from l3worker.engine.kv_events import KVEventsConfig
from l3worker.engine.step_loop import Engine
from l3worker.errors import ChildFailure, WorkerError
from l3worker.hub import resolve_model
from l3worker.engine.inputs import Prompt, per_prompt
from l3worker.distributed.nodes import NodeLayout, RemoteNode
from l3worker.params import RequestOutput, SamplingParams
from l3worker.engine.recovery import RestartPolicy
from l3worker.engine.requests import RequestState
from l3worker.engine.stats import GenerateStats, advance_bar
from l3worker.worker.rollout import RolloutControls
from l3worker.worker.socket_dir import make_socket_dir
from l3worker.worker.teardown import live_workers, run_every

RESTART_GRACE_S = 2.0  # how long a failed generation's live children may take to exit before a kill


class DistributedWorker(RolloutControls, LoraControls):
    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        revision: str | None = None,
        download_dir: str | None = None,
        device_ids: Sequence[int] | None = None,
        device: str = "auto",
        max_batch_size: int = 16,
        max_seq_len: int = 4096,
        page_size: int | None = None,  # tokens per KV page; None: the device's (default_page_size)
        num_pages: int | None = None,
        # vLLM's: size the KV cache from this fraction of the device's memory (kv_sizing.py);
        # None: room for max_seq_len in every row. num_pages, when given, overrides it.
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,  # vLLM's: the KV cache's bytes per device; wins over the fraction
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",  # vLLM's: "fp8" / "fp8_e4m3" store the KV pages in float8
        kv_offloading_size: float | None = None,  # vLLM's: GiB of host memory for evicted prefix pages
        pipeline_depth: int | None = None,  # None: default_pipeline_depth (4 on the cpu, else 2)
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",  # vLLM's: "priority" runs lower SamplingParams.priority first
        kv_events_config: KVEventsConfig | dict | str | None = None,  # vLLM's (l3worker/engine/kv_events.py)
        data_parallel_rank: int | None = None,  # an engine core's: it offsets the KV events' ports
        copy_policy: str = "dirty",
        attention_backend: str | None = None,
        decode_graphs: bool | None = None,
        fused_kernels: bool | None = None,
        cpu_prepack: bool | None = None,
        quantization: str | None = None,
        enable_expert_parallel: bool = False,
        enable_sleep_mode: bool = False,  # vLLM's: sleep() may free the weights and the KV cache (rollout.py)
        # vLLM's: LoRA adapters (lora_controls.py): max_loras in one batch, of rank up to max_lora_rank
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        overlap_steps: bool | None = None,
        step_timeout_s: float | None = 300.0,
        startup_timeout_s: float | None = 600.0,
        num_threads: int | None = None,
        cpu_layout: str = "auto",
        spin_wait_s: float = 0.003,
        pin_cores: bool = True,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        max_waiting_requests: int | None = None,
        stream_interval: int = 1,  # vLLM's: tokens per streamed delta; N > 1 reads N steps a wake-up (step_loop.py)
        speculative_config: SpeculativeConfig | dict | str | None = None,
        # Tensor parallel over several nodes, vLLM's names: this worker is the head (node 0); the
        # followers run l3worker.distributed.follower (`l3worker serve --headless`). See l3worker/distributed/nodes.py.
        tensor_parallel_size: int | None = None,  # None: one rank per device_ids entry
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        # test-only (see chip_child.serve): the fault of the first start; a sequence: one per
        # start, restarts included (None: none; starts past its end have none)
        fault_injection: str | Sequence[str | None] | None = None,
    ):
        if device not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {DEVICE_TYPES}, got {device!r}")
        if not isinstance(dtype, str):
            raise TypeError(f"dtype must be a name such as 'auto', 'bfloat16' or 'float32', got {dtype!r}")
        if copy_policy not in COPY_POLICIES:
            raise ValueError(f"copy_policy must be one of {COPY_POLICIES}, got {copy_policy!r}")
        speculative = None if speculative_config is None else SpeculativeConfig.of(speculative_config)
        check_speculation_switches(speculative is not None, decode_graphs, overlap_steps)
        # The backend and graph choices hold for the device type whatever its id: refused here,
        # before any child starts, with the choices named.
        kind = device_type(device)
        page_size = default_page_size(kind) if page_size is None else page_size
        if pipeline_depth is None:
            pipeline_depth = default_pipeline_depth(kind, speculative is not None)
        backend = get_backend(kind, attention_backend)
        check_kv_cache_dtype(cache_dtype_of(kv_cache_dtype), backend.name)
        resolve_decode_graphs(decode_graphs, kind, backend.decode_capturable, backend.name)
        resolve_fused_kernels(fused_kernels, kind)
        device_ids = tuple(device_ids) if device_ids is not None else None
        if device_ids is not None and not device_ids:
            raise ValueError("device_ids must name at least one device")
        layout = NodeLayout.of(tensor_parallel_size, device_ids, nnodes, node_rank, master_addr, master_port)
        if node_rank != 0:
            raise ValueError(f"node_rank={node_rank}: a DistributedWorker is the head, node 0; other nodes run "
                             "`l3worker serve --headless` (l3worker.distributed.follower)")
        device_ids = layout.local_devices(device_ids)
        for d in device_ids:
            positive_int("device_ids entry", d, 0)
        if len(set(device_ids)) != len(device_ids) and device != "cpu":
            raise ValueError(f"device_ids must not repeat a device, got {device_ids}")
        max_num_batched_tokens = check_limits(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, page_size=page_size, pipeline_depth=pipeline_depth,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            num_pages=num_pages, num_threads=num_threads, cpu_layout=cpu_layout, pin_cores=pin_cores,
            spin_wait_s=spin_wait_s, step_timeout_s=step_timeout_s, startup_timeout_s=startup_timeout_s,
            max_waiting_requests=max_waiting_requests, stream_interval=stream_interval)
        if stream_interval > 1:  # N steps read at once, and one more to keep the child busy meanwhile
            pipeline_depth = max(pipeline_depth, stream_interval + 1)
        restart_policy = RestartPolicy(max_restarts, restart_window_s)
        restart_policy.validate()
        # The model as the caller named it, path or Hub id (vLLM's served name).
        self.model_name = str(model_dir) if model_dir is not None else TINY_MODEL_SERVED_NAME
        self.model_dir = resolve_model(model_dir, revision, download_dir, "model_dir") if model_dir is not None \
            else str(ensure_tiny_model())
        self.model_config = load_config(self.model_dir, quantization)
        run_dtype = resolve_dtype(dtype, kind, self.model_config)  # rejects unknown names before any child starts
        resolve_cpu_prepack(cpu_prepack, kind, run_dtype)
        if max_seq_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{self.model_config.max_position_embeddings}")
        if not isinstance(enable_expert_parallel, bool):
            raise TypeError(f"enable_expert_parallel must be a bool, got {type(enable_expert_parallel).__name__}")
        # tensor parallelism must divide heads and MLP (expert parallelism: the experts)
        shard = shard_config(self.model_config, layout.tensor_parallel_size, enable_expert_parallel)
        kv_itemsize = 1 if cache_dtype_of(kv_cache_dtype) else run_dtype.itemsize  # an fp8 cache: a byte a value
        self.kv_sizing: KvSizing | None = None
        if (kv_bytes := kv_cache_bytes(kv_cache_memory_bytes, kind)) is not None:  # or VLLM_CPU_KVCACHE_SPACE
            self.kv_sizing = size_kv_cache_in(shard, kv_bytes, kind=kind, local_ranks=len(device_ids),
                                              kv_itemsize=kv_itemsize, page_size=page_size, max_seq_len=max_seq_len)
        elif gpu_memory_utilization is not None:
            self.kv_sizing = size_kv_cache(
                shard, fraction=gpu_memory_utilization, kind=kind, device_id=device_ids[0],
                itemsize=run_dtype.itemsize, local_ranks=len(device_ids), page_size=page_size, max_seq_len=max_seq_len,
                kv_itemsize=kv_itemsize)
        if self.kv_sizing is not None and num_pages is None:
            num_pages = self.kv_sizing.num_pages
        if speculative is not None:
            speculative = check_proposer(speculative, self.model_config, layout.tensor_parallel_size)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.loras = lora_registry(enable_lora, max_loras, max_lora_rank, max_cpu_loras, self.model_config,
                                   speculative is not None, layout.nnodes)
        self.runtime_config = RuntimeConfig(
            model_dir=self.model_dir, device=device, device_id=device_ids[0], dtype=dtype,
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, page_size=page_size, num_pages=num_pages,
            max_prefill_tokens=max_num_batched_tokens, copy_policy=copy_policy, num_threads=num_threads,
            attention_backend=attention_backend, decode_graphs=decode_graphs, fused_kernels=fused_kernels,
            cpu_prepack=cpu_prepack, quantization=quantization, enable_expert_parallel=enable_expert_parallel,
            speculative=None if speculative is None else speculative.to_dict(), enable_sleep_mode=enable_sleep_mode,
            kv_cache_dtype=kv_cache_dtype, max_loras=max_loras if self.loras else 0, max_lora_rank=max_lora_rank,
            host_kv_pages=host_tier_pages(shard, kv_offloading_size, kv_itemsize, page_size))
        self.speculative_config, self.device_ids, self.layout = speculative, device_ids, layout
        self._nodes: list[RemoteNode] = []  # one per follower node, made once: their links outlive restarts
        self.pipeline_depth = pipeline_depth
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.spin_wait_s = spin_wait_s  # how long the parent spins on the doorbell before it sleeps
        self.pin_cores = pin_cores
        self.cpu_layout = cpu_layout
        self._doorbell: Doorbell | None = None
        self._core_plan: CorePlan | None = None
        self._faults = [fault_injection] if isinstance(fault_injection, str) or fault_injection is None \
            else list(fault_injection)
        self._generation = 0  # starts of the children so far, restarts included
        self._placement = CpuPlacement(cpu_layout, num_threads, pin_cores, device_type(device) == "cpu",
                                       step_weight_elements(self.model_config), layout.tensor_parallel_size,
                                       self.runtime_config.reachable_positions)
        check_optional_bool("overlap_steps", overlap_steps)
        self.overlap_steps = overlap_steps
        self._children: list[ChildProcess] = []
        self.early_child: EarlyChild | None = None  # a cpu child started ahead, for the first launch (engine core)
        self._ctx: zmq.Context | None = None
        self._socket_dir: str | None = None
        self._buffers: StepBuffers | None = None
        self._wake_fd: int | None = None  # the leader child's eventfd after each step (l3worker.worker.doorbell)
        self._state = "new"  # new -> ready -> closed
        self._prepare_s = 0.0
        self.engine = Engine(self.model_config, self.runtime_config, self.tokenizer, self.model_dir,
                             pipeline_depth, step_timeout_s, max_num_batched_tokens, enable_prefix_caching,
                             restart_policy, max_waiting_requests)
        self.engine.loras = self.loras
        self.engine.output_processor.stream_interval = stream_interval
        if self.loras is not None:
            self.engine.metrics.track_lora(partial(lora_info, self.engine))
        self.engine.scheduling_policy = check_choice("scheduling_policy", scheduling_policy, SCHEDULING_POLICIES)
        self.engine.kv_events_config = KVEventsConfig.of(kv_events_config)
        self.engine.kv_events_rank = data_parallel_rank
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
            self._buffers = StepBuffers.create(self.pipeline_depth + 1, cfg.max_batch_size, cfg.prefill_capacity,
                                               speculative_tokens(cfg))
            self._socket_dir = make_socket_dir("l3worker-")
            self._ctx = zmq.Context()
            self._wake_fd = make_wake_fd()
            self._state = "ready"  # from here on close() has something to release
            self._core_plan = plan = self._plan_cores()
            self._nodes = [RemoteNode(self._ctx, self.layout, node, self._buffers)
                           for node in range(1, self.layout.nnodes)]
            live_workers.add(self)
            if plan:
                pin_socket_threads(self._ctx, plan.service)  # before the first socket starts its threads
            grammars = self.engine.input_processor.grammars
            grammars.warm()  # the token trie builds while the children start
            self._launch()
            grammars.ready()
        except BaseException:
            self.close()
            raise
        self.engine.bind(self._children, self._buffers, self._doorbell, self._relaunch)
        self.engine.restart_waits_on_nodes = bool(self._nodes)
        self._prepare_s = time.perf_counter() - t0
        return self

    def _launch(self) -> None:
        """Starts one child per device and waits until each is ready: the first start and every
        restart. A restart's children differ only in their generation (their socket files and
        tensor-parallel rendezvous are new) and their test fault. Follower nodes start theirs on
        the head's word, with the same config."""
        cfg, plan, gen, layout = self.runtime_config, self._core_plan, self._generation, self.layout
        world = layout.tensor_parallel_size
        threads = self._placement.threads(len(self.device_ids))
        others_pinned = self._others_pinned()
        trial = self._placement.trial(others_pinned=others_pinned)
        step_core = self._placement.step_core(len(self.device_ids), others_pinned)
        cores = self._placement.cores if step_core is not None else None
        fault = self._faults[gen] if gen < len(self._faults) else None
        self._generation += 1
        early, self.early_child = self.early_child and self.early_child.usable(cfg.device, self.device_ids), None
        dist_init = None if world == 1 else layout.dist_init if layout.nnodes > 1 else \
            f"file://{self._socket_dir}/tp-store-{gen}"
        cfg = replace(cfg, tp_size=world, dist_init=dist_init)
        launch = dict(runtime=asdict(cfg), slots=self._buffers.slots, max_batch_size=cfg.max_batch_size,
                      prefill_capacity=cfg.prefill_capacity, fault=fault, overlap_steps=self.overlap_steps,
                      step_timeout_s=self.step_timeout_s, startup_timeout_s=self.startup_timeout_s)
        for node in self._nodes:  # first: a follower that is gone fails a restart before any child starts
            self._children.append(node)
            node.start(gen, dict(launch, node_rank=node.node), self.startup_timeout_s, self.engine.stopping)
        for rank, device_id in enumerate(self.device_ids):
            rc = replace(cfg, device_id=device_id, tp_rank=rank)
            if threads is not None:
                # The child's own default would count only the cores it is pinned to.
                rc = replace(rc, num_threads=threads)
            spec = child_spec(rank, rc, self._buffers, self._socket_dir, wake_every_step=not ORDERED_STORES,
                              wake_fd=self._wake_fd if rank == 0 else None,
                              # with a step core: all, for a restart forked from a thread kept off it
                              fault=fault, cpu_cores=plan.children[rank] if plan else cores, step_core=step_core,
                              service_cores=plan.service if plan else None, overlap_steps=self.overlap_steps,
                              layout_trial=trial, generation=gen)
            self._children.insert(rank, ChildProcess(self._ctx, spec, self._buffers, early))  # local ranks first
        wait_all_ready(self._children, self.startup_timeout_s, self.engine.stopping)
        # Restarts run what the trial chose, untimed (it takes seconds on a loaded machine).
        self._placement.started(trial, self._children[0].info.get("cpu_layout"), self.step_core)
        if trial is not None:
            self._core_plan = self._plan_cores()
        self._doorbell = Doorbell(self._buffers.doorbell.numpy(), self._children, self._spin_budget(),
                                  self.engine.stopping, self._wake_fd)
        self.engine.metrics.set_cpu_layout(self.cpu_layout_in_use)

    @property
    def cpu_layout_in_use(self) -> str | None:
        """The layout the cpu children run with (None off the cpu or before they started)."""
        info = self._children[0].info if self._children else {}
        return self._placement.in_use(info, len(self._children))

    @property
    def step_core(self) -> int | None:
        """The core a lone cpu child's step thread has to itself (every_core); serving processes
        keep their threads off it (chip_child.device.move_threads_off). None: no such core."""
        return self._children[0].info.get("step_core") if self._children else None

    def _relaunch(self) -> tuple[list[ChildProcess], Doorbell]:
        """The engine's restart: stops every child (tensor-parallel ranks go together), then
        starts fresh ones as prepare() did. Children that fail to start are stopped too."""
        self.check_relaunch()
        self._stop_children(RESTART_GRACE_S)
        try:
            self._launch()
        except ChildFailure:
            self._stop_children(RESTART_GRACE_S)
            raise
        return self._children, self._doorbell

    def _stop_children(self, grace_s: float) -> None:
        children, self._children, self._doorbell = self._children, [], None
        run_every(partial(child.stop, grace_s) for child in children)  # one that fails leaves none running

    def _others_pinned(self) -> bool:
        return any(w._core_plan or w.step_core is not None for w in live_workers if w is not self)

    def _plan_cores(self) -> CorePlan | None:
        return self._placement.plan(len(self.device_ids), self._others_pinned())

    def _spin_budget(self) -> float:
        return self._placement.spin_budget(self._children[0].info, len(self._children), self.spin_wait_s)

    def close(self) -> None:
        """Stops every child and frees what the worker holds. Idempotent; safe after failures: every
        step runs even when one before it raised, and the first such error is raised at the end."""
        run_every([
            self.engine.request_stop,  # a restart under way gives up instead of starting children
            self.early_child.discard if self.early_child else None,
            partial(self._stop_children, 5.0),
            self.engine.input_processor.grammars.close,  # its compile threads end with the worker
            self.engine.close_kv_events,
            self.loras.close if self.loras is not None else None,  # adapters' host copies in shared memory
            *(node.close for node in self._nodes),  # the followers see the link close and exit
            self._destroy_context,
            self._release_host,
        ])

    def _destroy_context(self) -> None:
        """Closes every socket, one whose child never started too."""
        ctx, self._ctx, self._nodes = self._ctx, None, []
        if ctx is not None:
            ctx.destroy(linger=0)

    def _release_host(self) -> None:
        """The socket directory, the wake fd and the step core; then the state is closed."""
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        self._buffers = self._doorbell = self._core_plan = None  # its cores are free for another worker
        if self._wake_fd is not None:
            fd, self._wake_fd = self._wake_fd, None
            os.close(fd)
        self._placement.release()
        if self._state != "closed" and self.engine.error is None:
            self.engine.fail(WorkerError("the worker was closed"))
        self._state = "closed"

    def __enter__(self) -> "DistributedWorker":
        return self.prepare()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_children", None):
            self.close()

    @property
    def healthy(self) -> bool:
        """Prepared, serving, and every child alive right now."""
        return self._state == "ready" and self.engine.healthy and all(c.alive for c in self._children)

    @property
    def child_pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def socket_dir(self) -> str | None:
        return self._socket_dir

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, lora_request=None) -> list[RequestOutput]:
        """Generates for every prompt and returns one final output per prompt, in order; more
        prompts than rows queue and enter as rows free up. Bad input raises before anything
        reaches a child and leaves the worker usable. `use_tqdm`: a progress bar (default: only
        when stderr is a terminal). `lora_request`: a LoRARequest, or one per prompt (None: the base)."""
        t0 = time.perf_counter()
        states = self._start(prompts, params, stream=False, t0=t0, lora_request=lora_request)
        bar = None
        if use_tqdm if use_tqdm is not None else sys.stderr.isatty():
            bar = tqdm(total=len(states), desc="Processed prompts", unit="req", dynamic_ncols=True)
        finals: dict[str, RequestOutput] = {}
        try:
            for out in self._drive(states):
                if out.finished:
                    finals[out.request_id] = out
                    if bar is not None:
                        advance_bar(bar, finals.values(), time.perf_counter() - t0)
        finally:
            if bar is not None:
                bar.close()
        return [finals[s.request_id] for s in states]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               lora_request=None) -> Iterator[RequestOutput]:
        """Yields outputs as tokens arrive: deltas (new tokens and text) while a request runs, then
        its final output (`finished`). Leaving the loop early aborts the requests still running."""
        states = self._start(prompts, params, stream=True, t0=time.perf_counter(), lora_request=lora_request)
        yield from self._drive(states)

    def _start(self, prompts, params, stream: bool, t0: float, lora_request=None) -> list[RequestState]:
        if self._state == "closed":
            raise WorkerError("this worker was closed; make a new DistributedWorker")
        if self.engine.driven_by_loop_thread:
            raise WorkerError("an AsyncEngine drives this worker: submit requests through it")
        # Every prompt is checked before any is queued: bad input leaves nothing behind.
        states = [self.engine.make_request(prompt, p, None, stream, f"prompts[{i}]", arrival=t0, lora_request=lora)
                  for i, (prompt, p, lora) in enumerate(per_prompt(prompts, params, lora_request))]
        self.prepare()
        self._last = GenerateStats(started_at=t0, setup_s=time.perf_counter() - t0, requests=len(states))
        self._generate_calls += 1
        for state in states:
            self.engine.submit(state)
        return states

    def _drive(self, states: list[RequestState]) -> Iterator[RequestOutput]:
        """Steps the engine until every one of `states` finished, yielding their outputs."""
        engine = self.engine
        mine = {s.request_id for s in states}
        left = set(mine)
        engine.output_processor.recorder = self._last
        try:
            while left:
                for out in engine.step():
                    if out.request_id in mine:
                        if out.finished:
                            left.discard(out.request_id)
                        yield out
        except GeneratorExit:
            for request_id in left:  # the caller stopped listening
                engine.abort(request_id)
            raise
        except BaseException:
            # Children may hold commands the parent no longer tracks (Ctrl-C, a child error or
            # death): the only safe state is none at all.
            self.close()
            raise
        finally:
            engine.output_processor.recorder = None
        self._last.wall_s = time.perf_counter() - self._last.started_at
        self._requests_served += len(states)

    # -- figures -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The worker's state, its children's start-up report and the engine's counters."""
        return worker_stats(self)

    def step_records(self) -> list[dict]:
        """Every step of the last generate() call, for --profile."""
        return self._last.step_table()
