"""The chip runtime: one device's model, KV cache, pooled step tensors and the step contract.

It runs in-process (tests, the benchmark floor) or inside a chip-child. `execute` applies one
command: finished rows, rows set up, new page triples and prompt chunks are the only inputs that
cross from the host; positions advance, slot mappings are computed and next tokens are sampled
on the device. The one host synchronisation of a decode step is the copy of the sampled ids into
`out`.

Every step is one forward over a packed token axis: the decode lanes first (a lane whose row is
not decoding writes to the scratch page and its token is ignored), then the tokens of each prompt
chunk. A chunk that ends its prompt hands its last hidden state to its row's lane, so one
sampler call serves decode rows and rows that just finished their prefill alike. A step runs
lanes [0, n) only, n the lane bucket of its highest active row (chip_child.graphs); the rows
above are idle and untouched. On cuda and npu the decode-only step's forward is a captured graph
per bucket, replayed without copying anything (chip_child.graphs). On cuda the elementwise
stages between the matmuls are fused Triton kernels (chip_child.fused).

Optional sampling stages (penalties, min_p, the min_tokens stop-id mask, log-probabilities) run
only in steps where some active row uses them, decided from host facts kept between admissions:
a batch that uses none runs exactly the plain sampler. Their per-row state (output token counts,
prompt tokens, stop ids) is set at admission and updated on the device from the sampled ids.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from chip_child.attention import AttentionMetadata, AttentionSpec, get_backend
from chip_child.device import DeviceTimer, default_cpu_threads, resolve_device
from chip_child.graphs import Capturer, DecodeGraphs, DeviceGraphs, bucket_of, resolve_decode_graphs
from chip_child.loader import ModelConfig, load_config, load_weights, resolve_dtype
from chip_child.fused import resolve_fused_kernels, triton_layer_ops
from chip_child.model import TORCH_OPS, Qwen3Weights, final_logits, forward, rope_table, shard_config
from chip_child.pool import TaskArg, TensorPool
from chip_child.prepack import resolve_cpu_prepack
from chip_child.protocol import MAX_LOGPROBS, Admit, Chunk, Command, FullState, Limits, prefill_command
from chip_child.sampling import Features, RowParams, sample, sample_with_features, seed_key, vocab_hash

COPY_POLICIES = ("dirty", "always")
STATE = "state"  # pool owner of the tensors prefill and decode share
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose [rows, vocab] logits exist at once
# Pooled tensors with one entry per row: a step reads them narrowed to its lanes.
LANE_SLOTS = ("input_ids", "positions", "active", "block_table", "slot_mapping", "lane_seq_lens", "temperature",
              "top_p", "top_k", "seed_keys", "logits", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_pos", "output_counts", "prompt_seen", "stop_mask", "lp_values", "lp_ids")


@dataclass
class RuntimeConfig:
    model_dir: str
    device: str = "auto"
    device_id: int = 0
    dtype: str = "auto"
    max_batch_size: int = 16
    max_seq_len: int = 4096
    page_size: int = 128
    num_pages: int | None = None  # None: every row can reach max_seq_len
    max_prefill_tokens: int | None = None  # chunk tokens per step; None: max(max_seq_len, 2048)
    copy_policy: str = "dirty"
    attention_backend: str | None = None  # None: the device's default (see chip_child.attention)
    decode_graphs: bool | None = None  # None: on for cuda and npu where the backend allows (chip_child.graphs)
    fused_kernels: bool | None = None  # None: on for cuda where triton imports (chip_child.fused)
    cpu_prepack: bool | None = None  # None: on for the cpu where oneDNN runs the dtype (chip_child.prepack)
    num_threads: int | None = None  # cpu intra-op threads; None: see default_cpu_threads
    tp_rank: int = 0
    tp_size: int = 1
    dist_init: str | None = None  # torch.distributed init_method when tp_size > 1

    @property
    def max_blocks_per_row(self) -> int:
        return math.ceil(self.max_seq_len / self.page_size)

    @property
    def total_pages(self) -> int:
        """Pages in the cache, counting page 0, the scratch page idle rows write to."""
        if self.num_pages is not None:
            return self.num_pages + 1
        return self.max_batch_size * self.max_blocks_per_row + 1

    @property
    def reachable_positions(self) -> int:
        """Positions one row can take: below max_seq_len, and within the pool's pages."""
        return min(self.max_seq_len - 1, (self.total_pages - 1) * self.page_size)

    @property
    def prefill_capacity(self) -> int:
        return self.max_prefill_tokens or max(self.max_seq_len, 2048)

    def limits(self) -> Limits:
        return Limits(self.max_batch_size, self.max_blocks_per_row, self.total_pages,
                      self.max_seq_len, self.prefill_capacity, self.page_size)


@dataclass
class BatchFacts:
    """What the host knows of the batch between admissions: kept, not recomputed each step."""

    furthest: int  # the longest active row's position (this step's input position)
    any_random: bool
    any_filter: bool
    any_active: bool
    any_penalty: bool = False
    any_min_p: bool = False  # a random row with min_p > 0
    mask_steps: int = 0  # decode steps, this one first, in which some row still masks its stop ids
    logprobs: int = -1  # the largest N an active row asked for; -1: none
    plain: bool = True  # none of the four above: the plain sampler alone
    lanes: int = 1  # the lane bucket holding every active row

    def update_plain(self) -> None:
        self.plain = not (self.any_penalty or self.any_min_p or self.mask_steps > 0 or self.logprobs >= 0)


@dataclass
class StepOutputs:
    """Host views a step's log-probabilities are written into (a ring slot's, in a chip-child);
    K = MAX_LOGPROBS. Written only when some row of the step asked: `logprobs` [B, 1 + K]
    ([:, 0] the sampled token's, [:, 1:1+N] the top N) with `logprob_ids` [B, K]; and
    `prompt_logprobs` [P, 1 + K] with `prompt_logprob_ids` [P, K], where entry staging_offset + j - 1
    is prompt token j's, given tokens 0..j-1, and the top N there (j = 1..prompt_len-1)."""

    logprobs: torch.Tensor  # float32 [max_batch_size, 1 + K]
    logprob_ids: torch.Tensor  # int32 [max_batch_size, K]
    prompt_logprobs: torch.Tensor  # float32 [prefill_capacity, 1 + K]
    prompt_logprob_ids: torch.Tensor  # int32 [prefill_capacity, K]

    @classmethod
    def allocate(cls, max_batch_size: int, prefill_capacity: int) -> "StepOutputs":
        k = MAX_LOGPROBS
        return cls(torch.zeros(max_batch_size, 1 + k), torch.zeros(max_batch_size, k, dtype=torch.int32),
                   torch.zeros(prefill_capacity, 1 + k), torch.zeros(prefill_capacity, k, dtype=torch.int32))


@dataclass
class StepResult:
    apply_s: float
    device_s: float
    h2d_copies: int
    h2d_bytes: int
    pool_allocs: int
    logprobs: int = -1  # N of the per-row log-probabilities written into the outputs; -1: none
    prompt_logprobs: bool = False  # prompt log-probabilities were written


@dataclass
class LaunchedStep:
    """A step whose work is queued (ChipRuntime.launch) and not yet completed."""

    result: StepResult
    out: torch.Tensor
    lanes: int
    ids_host: torch.Tensor | None  # pinned host copy of the sampled ids, once `done` fired; None on the cpu
    done: object | None  # the device event after that copy
    timer: DeviceTimer


@dataclass
class ChunkPlan:
    """What the host knows of a step's prompt chunks: sizes for slicing the pooled buffers, the
    metadata's host lengths, and which rows start decoding after this step."""

    num_tokens: int  # chunk tokens after the step's decode lanes
    num_chunks: int
    max_query_len: int
    query_lens: list[int]  # per sequence: the lanes, then the chunks
    seq_lens: list[int]
    last_rows: int  # chunks that end their prompt, first in last_* buffers
    penalized: list[tuple[int, int, int, int]]  # (row, first packed index, prompt tokens, output tokens)
    prompt_asks: list[tuple[int, int, int, int]]  # (first packed index, targets, staging offset, top N)


class ChipRuntime:
    # Inference mode throughout: tensors without autograd bookkeeping make each small op cheaper,
    # which is most of a decode step's cost on the cpu.
    @torch.inference_mode()
    def __init__(self, cfg: RuntimeConfig, graph_capturer: Capturer | None = None):
        """`graph_capturer` replaces the device's graph capture (tests drive the graph path on
        the cpu with a stand-in); given, decode graphs are on whatever `cfg.decode_graphs` says."""
        if cfg.copy_policy not in COPY_POLICIES:
            raise ValueError(f"copy_policy must be one of {COPY_POLICIES}, got {cfg.copy_policy!r}")
        t0 = time.perf_counter()
        self.cfg = cfg
        self.device = resolve_device(cfg.device, cfg.device_id)
        if cfg.num_threads or self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or default_cpu_threads(cfg.tp_size))
        full_cfg = load_config(cfg.model_dir)
        self.dtype = resolve_dtype(cfg.dtype, self.device.type, full_cfg)
        self.model_cfg: ModelConfig = shard_config(full_cfg, cfg.tp_size)  # this rank's heads and MLP slice
        self._all_reduce = self._init_tensor_parallel() if cfg.tp_size > 1 else (lambda x: x)
        # Fuse and shard on the host (memory-mapped), so only this rank's weights reach the device.
        host = load_weights(cfg.model_dir, full_cfg, self.dtype, "cpu")
        self.weights = Qwen3Weights.from_hf(host, full_cfg, cfg.tp_rank, cfg.tp_size).to(self.device)
        del host
        self.cpu_prepack = resolve_cpu_prepack(cfg.cpu_prepack, self.device.type, self.dtype)
        if self.cpu_prepack:
            self.weights.prepack()
        mc = self.model_cfg
        self.rope = rope_table(mc, cfg.max_seq_len, self.dtype, self.device)
        self.ops = triton_layer_ops() if resolve_fused_kernels(cfg.fused_kernels, self.device.type) else TORCH_OPS
        self.limits = replace(cfg.limits(), vocab_size=mc.vocab_size)
        self.pool = TensorPool(self.device)
        # One step function; two names, so a step's kind shows in dispatch (and fault injection).
        self._callables = {"prefill": self._step, "decode": self._step}
        self._h2d_copies = 0
        self._h2d_bytes = 0
        # Two of each per-step record (timer events; on accelerators, pinned buffers for the sampled
        # ids): a step's can still be in flight while the next step is launched (launch / complete).
        self._timers = (DeviceTimer(self.device), DeviceTimer(self.device))
        self._ids_host = self._ids_events = None
        self._flip = 0
        if self.device.type != "cpu":
            api = getattr(torch, self.device.type)
            self._ids_host = torch.zeros(2, cfg.max_batch_size, dtype=torch.int64, pin_memory=True)
            self._ids_events = [api.Event(), api.Event()]

        b, mb, v, p = cfg.max_batch_size, cfg.max_blocks_per_row, mc.vocab_size, cfg.prefill_capacity
        spec = AttentionSpec(num_layers=mc.num_layers, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                             head_dim=mc.head_dim, num_pages=cfg.total_pages, page_size=cfg.page_size,
                             dtype=self.dtype, max_tokens=b + p, max_seqs=2 * b, max_blocks=mb)
        backend = get_backend(self.device.type, cfg.attention_backend)
        graphs = resolve_decode_graphs(cfg.decode_graphs, self.device.type, backend.decode_capturable, backend.name)
        graphs = graphs or graph_capturer is not None
        # The torch backend's decode mirror keeps its books on the host: a graph would freeze them.
        options = {"decode_mirror": False} if graphs and backend.name == "torch" else {}
        self.attn = backend(spec, self.device, **options)
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        state = lambda slot, shape, dtype, role: TaskArg(slot, shape, dtype, role, owner=STATE)  # noqa: E731
        shared = (
            state("kv_cache", self.attn.kv_cache_shape, self.dtype, "inout"),
            *(state(f"attn_{name}", shape, dtype, "inout") for name, (shape, dtype) in
              self.attn.workspace_shapes.items()),
            state("input_ids", (b,), i64, "inout"),
            state("positions", (b,), i64, "inout"),
            state("active", (b,), torch.bool, "inout"),
            state("block_table", (b, mb), i32, "in"),
            state("slot_mapping", (b,), i64, "inout"),
            state("lane_seq_lens", (b,), i32, "inout"),
            state("lane_starts", (b + 1,), i32, "in"),
            state("temperature", (b,), f32, "in"),
            state("top_p", (b,), f32, "in"),
            state("top_k", (b,), i64, "in"),
            state("seed_keys", (b,), i64, "in"),
            state("vocab_keys", (v,), i64, "in"),
            state("logits", (b, v), f32, "out"),
            state("min_p", (b,), f32, "in"),
            state("presence_penalty", (b,), f32, "in"),
            state("frequency_penalty", (b,), f32, "in"),
            state("repetition_penalty", (b,), f32, "in"),
            state("min_pos", (b,), i64, "in"),
            state("output_counts", (b, v), f32, "inout"),
            state("prompt_seen", (b, v), f32, "inout"),  # 1.0 / 0.0: float arithmetic is faster than bool
            state("stop_mask", (b, v), torch.bool, "in"),
            state("lp_values", (b, 1 + MAX_LOGPROBS), f32, "out"),
            state("lp_ids", (b, MAX_LOGPROBS), i64, "out"),
        )
        self.decode_args = shared
        self.prefill_args = shared + (
            # [lanes | chunk tokens] on the packed axis; the host fills the chunk part in one copy.
            TaskArg("tokens", (b + p,), i64, "in"),
            TaskArg("token_positions", (b + p,), i64, "in"),
            TaskArg("token_slots", (b + p,), i64, "inout"),
            TaskArg("chunk_ints", (4 * p + 8 * b + 2,), i64, "in"),
            TaskArg("prompt_lp_values", (p, 1 + MAX_LOGPROBS), f32, "out"),
            TaskArg("prompt_lp_ids", (p, MAX_LOGPROBS), i64, "out"),
        )
        self.state = self.pool.resolve("decode", self.decode_args)  # the step's shared tensors, by slot
        self.prefill_state = self.pool.resolve("prefill", self.prefill_args)
        self.attn.bind(self.state["kv_cache"], {name: self.state[f"attn_{name}"] for name in self.attn.workspace_shapes})
        self.state["vocab_keys"].copy_(vocab_hash(v, self.device))
        self.state["lane_starts"].copy_(torch.arange(b + 1, dtype=i32))
        self._bucket = bucket_of(b).tolist()  # highest active row + 1 -> the lanes a step runs
        # Each bucket's views of the pooled tensors, made once: fixed addresses a graph can read.
        self._lane_views = {n: {**{slot: self.state[slot][:n] for slot in LANE_SLOTS},
                                "lane_starts": self.state["lane_starts"][:n + 1],
                                "vocab_keys": self.state["vocab_keys"]}
                            for n in sorted(set(self._bucket))}
        self.graphs: DecodeGraphs | None = None  # set once warm-up captured them; warm-up itself runs eagerly
        self._pending_graphs = DecodeGraphs(graph_capturer or DeviceGraphs(self.device)) if graphs else None

        # Host mirrors of per-row facts the child needs without reading the device.
        self._positions = np.zeros(b, np.int64)
        self._active = np.zeros(b, bool)
        self._temperature = np.zeros(b, np.float32)
        self._filtered = np.zeros(b, bool)
        self._min_p = np.zeros(b, np.float32)
        self._penalized = np.zeros(b, bool)
        self._min_pos = np.zeros(b, np.int64)
        self._logprobs = np.full(b, -1, np.int64)
        self._prompt_len = np.zeros(b, np.int64)
        self._prompt_lp_top = np.full(b, -1, np.int64)
        self._batch_facts: BatchFacts | None = None
        self._slot_steps = 0  # decode steps whose slots are the previous step's plus one

        self._warm_up()
        self.warm_pool_allocations = self.pool.allocations
        self.setup_s = time.perf_counter() - t0

    def _init_tensor_parallel(self):
        import torch.distributed as dist

        backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.device.type]
        dist.init_process_group(backend, init_method=self.cfg.dist_init, rank=self.cfg.tp_rank,
                                world_size=self.cfg.tp_size)

        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

        return all_reduce

    def close(self) -> None:
        """Frees the graphs and pooled tensors and leaves the process group."""
        self.graphs = None
        self._lane_views = {}
        self.pool.release()
        if self.cfg.tp_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def register_callable(self, name: str, fn) -> None:
        """Callables are registered before the first step; `submit_next_level` names them."""
        self._callables[name] = fn

    # -- the single dispatch point ---------------------------------------------------------------
    def submit_next_level(self, callable_name: str, task_args: tuple[TaskArg, ...], **scalars):
        """Runs a registered callable on the pooled tensors its arguments name."""
        if not torch.is_inference_mode_enabled():  # called from outside a step: the pool holds inference tensors
            with torch.inference_mode():
                return self.submit_next_level(callable_name, task_args, **scalars)
        return self._callables[callable_name](**self.pool.resolve(callable_name, task_args), **scalars)

    # -- applying a command ----------------------------------------------------------------------
    def execute(self, cmd: Command, staging: np.ndarray, out: torch.Tensor,
                outputs: StepOutputs | None = None) -> StepResult:
        """Applies one validated command and writes the sampled id of every row into `out` [B],
        and, when `outputs` is given and some row asked, log-probabilities into it (see
        StepOutputs; without `outputs` none are computed). A step that raises leaves host and
        device state out of step with each other: a chip-child refuses every later command, and
        an in-process user must build a new runtime."""
        return self.complete(self.launch(cmd, staging, out, outputs))

    @torch.inference_mode()
    def launch(self, cmd: Command, staging: np.ndarray, out: torch.Tensor,
               outputs: StepOutputs | None = None) -> "LaunchedStep":
        """The first half of `execute`: applies the command and queues the step's work. On the
        cpu the step is done when this returns. On an accelerator the sampled ids are on their
        way to a pinned host buffer, and `complete` waits for them: a chip-child launches the
        next step before completing this one, so the device never waits for the host between
        steps. Log-probabilities, when a row asked, are copied before this returns (the next
        step would overwrite them on the device)."""
        t0 = time.perf_counter()
        self._flip ^= 1
        timer = self._timers[self._flip]
        copies0, bytes0, allocs0 = self._h2d_copies, self._h2d_bytes, self.pool.allocations
        if cmd.finished_rows:
            self.finish_rows(cmd.finished_rows)
        if cmd.admits:
            self._set_up_rows(cmd.admits)
        if len(cmd.new_pages):
            rows, blocks, pages = self._h2d(cmd.new_pages.astype(np.int64)).unbind(1)
            self.state["block_table"][rows, blocks] = pages.to(torch.int32)
            self._slot_steps = 0  # a row's current page may have changed: recompute its slot
        timer.start()
        if cmd.full_state is not None:
            self._load_full_state(cmd.full_state)
        n, plan, lanes = self._run_step(cmd.chunks, staging, cmd.full_state is None, outputs is not None)
        timer.stop()
        # The sampled ids: the step's only synchronisation. Lanes [0, lanes) hold every active
        # row, the only rows the parent reads; the rest of `out` is left as it was.
        v = self._lane_views[lanes]
        done = None
        if self._ids_host is None:
            out[:lanes].copy_(v["input_ids"])
        else:
            host = self._ids_host[self._flip, :lanes]
            host.copy_(v["input_ids"], non_blocking=True)
            done = self._ids_events[self._flip]
            done.record()
        if n >= 0:
            outputs.logprobs[:lanes, :1 + n].copy_(v["lp_values"][:, :1 + n])
            outputs.logprob_ids[:lanes, :n].copy_(v["lp_ids"][:, :n])
        asks = plan.prompt_asks if plan is not None else ()
        if asks:
            values, ids = self.prefill_state["prompt_lp_values"], self.prefill_state["prompt_lp_ids"]
            for first, count, offset, top in asks:
                outputs.prompt_logprobs[offset:offset + count, :1 + top].copy_(values[first:first + count, :1 + top])
                outputs.prompt_logprob_ids[offset:offset + count, :top].copy_(ids[first:first + count, :top])
        result = StepResult(
            apply_s=time.perf_counter() - t0,
            device_s=0.0,
            h2d_copies=self._h2d_copies - copies0,
            h2d_bytes=self._h2d_bytes - bytes0,
            pool_allocs=self.pool.allocations - allocs0,
            logprobs=n,
            prompt_logprobs=bool(asks),
        )
        return LaunchedStep(result, out, lanes, None if done is None else host, done, timer)

    def complete(self, step: "LaunchedStep") -> StepResult:
        """Waits for a launched step's sampled ids and writes them into its `out`."""
        if step.done is not None:
            step.done.synchronize()
            step.out[:step.lanes].copy_(step.ids_host)
        step.result.device_s = step.timer.elapsed_s()
        return step.result

    @property
    def logits(self) -> torch.Tensor:
        """Last step's fp32 logits per row (rows that neither decoded nor ended a prompt: garbage)."""
        return self.state["logits"]

    def positions_host(self) -> np.ndarray:
        return self._positions.copy()

    # -- internals -------------------------------------------------------------------------------
    def _h2d(self, arr: np.ndarray) -> torch.Tensor:
        """Every host-to-device transfer goes through here so the counters see it."""
        self._h2d_copies += 1
        self._h2d_bytes += arr.nbytes
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    @torch.inference_mode()
    def finish_rows(self, rows: list[int]) -> None:
        idx = self._h2d(np.asarray(rows, np.int64))
        self.state["active"][idx] = False
        self.state["positions"][idx] = 0
        self._active[rows] = False
        self._positions[rows] = 0
        self._rows_changed()

    def _rows_changed(self) -> None:
        """Rows were admitted, finished or overwritten: the host-side facts of the batch are
        recomputed before the next decode step instead of on every step."""
        self._batch_facts = None
        self._slot_steps = 0

    def _facts(self) -> BatchFacts:
        if self._batch_facts is None:
            act = self._active
            live = self._positions[act]
            random = self._temperature[act] > 0
            facts = BatchFacts(int(live.max()) if live.size else 0, bool(random.any()),
                               bool(self._filtered[act].any()), bool(live.size))
            facts.lanes = self._bucket[int(np.flatnonzero(act)[-1]) + 1 if live.size else 0]
            if live.size:
                facts.any_penalty = bool(self._penalized[act].any())
                facts.any_min_p = bool((random & (self._min_p[act] > 0)).any())
                facts.mask_steps = max(0, int((self._min_pos[act] - live).max()))
                facts.logprobs = int(self._logprobs[act].max())
            facts.update_plain()
            self._batch_facts = facts
        return self._batch_facts

    def _step_features(self, facts: BatchFacts, want_logprobs: bool) -> Features | None:
        """This step's optional stages; None when it runs the plain sampler."""
        mask = facts.mask_steps > 0
        if mask:
            facts.mask_steps -= 1
            if not facts.mask_steps:
                facts.update_plain()
        logprobs = facts.logprobs if want_logprobs else -1
        if not (facts.any_penalty or facts.any_min_p or mask or logprobs >= 0):
            return None
        return Features(facts.any_penalty, facts.any_min_p, mask, logprobs)

    def _set_up_rows(self, admits: list[Admit]) -> None:
        """Rows taken by new sequences: sampling parameters and per-row state; not active until
        their last chunk ran, and with an empty block table until triples fill it."""
        rows = np.array([a.row for a in admits], np.int64)
        floats = np.array([[a.temperature, a.top_p, a.min_p, a.presence_penalty, a.frequency_penalty,
                            a.repetition_penalty] for a in admits], np.float32)
        # Stop ids are masked while the input position is below min_pos: never for a row without them.
        stops = [np.asarray(a.stop_ids, np.int64) if a.min_tokens > 0 else np.zeros(0, np.int64) for a in admits]
        min_pos = np.array([a.prompt_len - 1 + a.min_tokens if s.size else 0 for a, s in zip(admits, stops)],
                           np.int64)
        ints = np.stack([np.array([a.top_k for a in admits], np.int64),
                         np.array([seed_key(a.seed) for a in admits], np.int64), min_pos], axis=1)
        penalized = np.array([a.uses_penalties for a in admits], bool)
        idx = self._h2d(rows)
        st = self.state
        st["active"][idx] = False
        st["positions"][idx] = 0
        st["block_table"][idx] = 0
        dev_floats = self._h2d(floats)
        for j, name in enumerate(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty")):
            st[name][idx] = dev_floats[:, j]
        dev_ints = self._h2d(ints)
        for j, name in enumerate(("top_k", "seed_keys", "min_pos")):
            st[name][idx] = dev_ints[:, j]
        for a, uses in zip(admits, penalized):
            if uses:  # counted from the row's chunks as they run
                st["output_counts"][a.row].zero_()
                st["prompt_seen"][a.row].zero_()
        if min_pos.any():
            vocab = self.model_cfg.vocab_size
            for a, m in zip(admits, min_pos):
                if m:
                    st["stop_mask"][a.row].zero_()
            flat = np.concatenate([a.row * vocab + s for a, s in zip(admits, stops)])
            st["stop_mask"].view(-1)[self._h2d(flat)] = True
        self._active[rows] = False
        self._positions[rows] = 0
        self._temperature[rows] = floats[:, 0]
        self._filtered[rows] = (ints[:, 0] > 0) | (floats[:, 1] < 1)
        self._min_p[rows] = floats[:, 2]
        self._penalized[rows] = penalized
        self._min_pos[rows] = min_pos
        self._logprobs[rows] = [a.logprobs for a in admits]
        self._prompt_len[rows] = [a.prompt_len for a in admits]
        self._prompt_lp_top[rows] = [a.prompt_logprobs for a in admits]
        self._rows_changed()

    def _run_step(self, chunks: list[Chunk], staging: np.ndarray, compute_slots: bool,
                  want_logprobs: bool) -> tuple[int, ChunkPlan | None, int]:
        """Returns N of the per-row log-probabilities computed (-1: none), the chunks' plan and
        the lanes the step ran."""
        plan = self._plan_chunks(chunks, staging, want_logprobs) if chunks else None
        facts = self._facts()
        features = None if facts.plain else self._step_features(facts, want_logprobs)
        if facts.furthest >= self.cfg.max_seq_len:
            raise ValueError(f"a row would pass max_seq_len={self.cfg.max_seq_len}: the parent sent a step too many")
        page, lanes = self.cfg.page_size, facts.lanes
        if not compute_slots:
            slots = "given"
        elif self._slot_steps > 0 and plan is None:
            slots = "advance"
            self._slot_steps -= 1
        else:
            slots = "compute"
            # Every active row stays on its current page for this many more steps.
            live = self._positions[self._active]
            self._slot_steps = int((page - 1 - live % page).min()) if live.size and plan is None else 0
        self.submit_next_level("prefill" if plan else "decode", self.prefill_args if plan else self.decode_args,
                               plan=plan, lanes=lanes, lane_lens=self._positions[:lanes] + 1,
                               max_lane_len=facts.furthest + 1, any_random=facts.any_random,
                               any_filter=facts.any_filter, slots=slots, features=features)
        self._positions += self._active
        facts.furthest += facts.any_active
        return (-1 if features is None else features.logprobs), plan, lanes

    def _plan_chunks(self, chunks: list[Chunk], staging: np.ndarray, want_logprobs: bool) -> ChunkPlan:
        """Marks the rows whose prompt ends here as decoding from this step's sample on, then
        copies the chunks' ids, positions and metadata (laid out after the step's lanes, which
        now include those rows) to the device in one transfer."""
        lens = [c.length for c in chunks]
        total = sum(lens)
        for c in chunks:
            if self._active[c.row]:
                raise ValueError(f"chunk for row {c.row}, which is decoding")
        starts = np.cumsum([0] + lens[:-1])
        targets, asks, penalized = [], [], []
        for c, s in zip(chunks, starts):
            plen = int(self._prompt_len[c.row])
            if self._penalized[c.row]:
                in_prompt = max(0, min(c.start + c.length, plen) - c.start)
                penalized.append((c.row, int(s), in_prompt, c.length - in_prompt))
            top = int(self._prompt_lp_top[c.row])
            if want_logprobs and top >= 0 and c.start < plen - 1:
                count = min(c.start + c.length, plen - 1) - c.start
                if c.staging_offset + count >= len(staging):
                    raise ValueError(f"chunk of row {c.row}: its prompt-logprob targets run past the staging slot")
                asks.append((int(s), count, c.staging_offset, top))
                targets.append(staging[c.staging_offset + 1:c.staging_offset + 1 + count])
        last = [(c, int(s)) for c, s in zip(chunks, starts) if c.last]
        for c, _ in last:
            self._active[c.row] = True
            self._positions[c.row] = c.start + c.length - 1  # the input position its sample counts from
        self._rows_changed()
        n = self._facts().lanes
        ids = np.concatenate([staging[c.staging_offset:c.staging_offset + c.length] for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.start + c.length) for c in chunks])
        rows = np.repeat([c.row for c in chunks], lens)
        seq_lens = [c.start + c.length for c in chunks]
        ends = n + np.cumsum(lens)
        # chunk_ints: ids | positions | rows | query starts (n + C + 1) | chunk seq lens (C) |
        # metadata rows (n + C) | last rows | their packed index | prompt-logprob targets
        ints = np.concatenate([ids, positions, rows, np.arange(n + 1), ends, seq_lens,
                               np.arange(n), [c.row for c in chunks], [c.row for c, _ in last],
                               [n + s + c.length - 1 for c, s in last], *targets]).astype(np.int64)
        self.prefill_state["chunk_ints"][:len(ints)].copy_(self._h2d(ints))
        host_lens = self._positions[:n] + 1
        return ChunkPlan(total, len(chunks), max(lens), [1] * n + lens, host_lens.tolist() + seq_lens, len(last),
                         penalized, asks)

    def _step(self, *, plan: ChunkPlan | None, lanes: int, lane_lens: np.ndarray, max_lane_len: int,
              any_random: bool, any_filter: bool, slots: str, features: Features | None, tokens=None,
              token_positions=None, token_slots=None, chunk_ints=None, prompt_lp_values=None, prompt_lp_ids=None,
              **pooled) -> None:
        """One step over lanes [0, lanes) of the pooled tensors the task arguments name, through
        their views made once per bucket; rows above are idle and left untouched."""
        v = self._lane_views[lanes]
        if plan is None:
            if self.graphs is not None:
                self.graphs.replay(lanes)  # its inputs are already where the command and the last step left them
            else:
                self._decode_logits(v, slots, max_lane_len, lane_lens)
        else:
            self._lane_slots(v, slots)
            torch.add(v["positions"], 1, out=v["lane_seq_lens"])
            hidden = self._forward_chunks(plan, lanes, v, tokens, token_positions, token_slots, chunk_ints)
            row_hidden = hidden[:lanes]
            t, c = plan.num_tokens, plan.num_chunks
            ints = chunk_ints[3 * t + 2 * lanes + 3 * c + 1:]
            last_rows, last_index = ints[:plan.last_rows], ints[plan.last_rows:2 * plan.last_rows]
            if plan.last_rows:  # a row whose prompt ends here samples from its last token
                row_hidden.index_copy_(0, last_rows, hidden.index_select(0, last_index))
                v["positions"][last_rows] = token_positions.index_select(0, last_index)
                v["active"][last_rows] = True
            # Chunk rows not ending their prompt may sit above the lanes: the full per-row state.
            self._chunk_side_effects(plan, lanes, hidden, tokens, ints[2 * plan.last_rows:], pooled["output_counts"],
                                     pooled["prompt_seen"], prompt_lp_values, prompt_lp_ids)
            final_logits(self.weights, row_hidden, out=v["logits"], ops=self.ops)
        self._sample(v, any_random, any_filter, features)

    def _lane_slots(self, v: dict[str, torch.Tensor], slots: str) -> None:
        page = self.cfg.page_size
        if slots == "compute":
            positions = v["positions"]
            blocks = v["block_table"].gather(1, (positions // page)[:, None]).squeeze(1)
            # Idle lanes write to slot 0 of the scratch page, never into a page another row owns.
            torch.mul(blocks * page + positions % page, v["active"], out=v["slot_mapping"])
        elif slots == "advance":
            v["slot_mapping"].add_(v["active"])  # no active row crosses a page boundary this step

    def _decode_logits(self, v: dict[str, torch.Tensor], slots: str, max_seq_len: int,
                       seq_lens_host: np.ndarray | None) -> None:
        """A decode-only step's forward into v["logits"]. Eager steps pass the exact longest
        context and host lengths; a graph is captured with "compute" slots, the config's
        max_seq_len and no host lengths, so nothing of one step is frozen into it."""
        self._lane_slots(v, slots)
        torch.add(v["positions"], 1, out=v["lane_seq_lens"])
        meta = AttentionMetadata(v["lane_starts"], v["lane_seq_lens"], v["block_table"], v["slot_mapping"], 1,
                                 max_seq_len, seq_lens_host=seq_lens_host)
        hidden = forward(self.model_cfg, self.weights, self.attn, self.attn.plan(meta), self.rope, v["input_ids"],
                         v["positions"], self._all_reduce, self.ops)
        final_logits(self.weights, hidden, out=v["logits"], ops=self.ops)

    def _sample(self, v: dict[str, torch.Tensor], any_random: bool, any_filter: bool,
                features: Features | None) -> None:
        """The lanes' next ids into v["input_ids"]; then active lanes' positions advance."""
        logits, input_ids, positions, active = v["logits"], v["input_ids"], v["positions"], v["active"]
        # Idle lanes' ids are never read: the parent ignores them and a chunk overwrites them.
        if features is None:
            input_ids.copy_(sample(logits, v["temperature"], v["top_k"], v["top_p"], v["seed_keys"], positions,
                                   v["vocab_keys"], any_random, any_filter))
        else:
            params = RowParams(v["temperature"], v["top_k"], v["top_p"], v["seed_keys"], v["min_p"],
                               v["presence_penalty"], v["frequency_penalty"], v["repetition_penalty"], v["min_pos"],
                               v["output_counts"], v["prompt_seen"], v["stop_mask"])
            input_ids.copy_(sample_with_features(logits, params, positions, v["vocab_keys"], any_random, any_filter,
                                                 features, v["lp_values"], v["lp_ids"]))
            if features.penalties:  # the sampled ids join their rows' outputs, on the device
                v["output_counts"].scatter_add_(1, input_ids[:, None], active[:, None].to(torch.float32))
        positions.add_(active)

    def _forward_chunks(self, plan: ChunkPlan, lanes: int, v: dict[str, torch.Tensor], tokens, token_positions,
                        token_slots, chunk_ints) -> torch.Tensor:
        """The forward of a step with chunks: `lanes` lanes and the chunk tokens on one packed axis."""
        page = self.cfg.page_size
        t, c, n = plan.num_tokens, plan.num_chunks, lanes
        total = n + t
        ids, pos, rows = chunk_ints[:t], chunk_ints[t:2 * t], chunk_ints[2 * t:3 * t]
        meta_ints = chunk_ints[3 * t:]
        block_table = self.state["block_table"]  # chunk rows may sit above the lanes
        tokens[:n].copy_(v["input_ids"])
        tokens[n:total].copy_(ids)
        token_positions[:n].copy_(v["positions"])
        token_positions[n:total].copy_(pos)
        token_slots[:n].copy_(v["slot_mapping"])
        torch.add(block_table[rows, pos // page].long() * page, pos % page, out=token_slots[n:total])
        starts = meta_ints[:n + c + 1].to(torch.int32)
        seq_lens = torch.cat([v["lane_seq_lens"], meta_ints[n + c + 1:n + 2 * c + 1].to(torch.int32)])
        seq_rows = meta_ints[n + 2 * c + 1:2 * n + 3 * c + 1]
        max_len = max(plan.seq_lens)
        width = -(-max_len // page)
        meta = AttentionMetadata(starts, seq_lens, block_table.index_select(0, seq_rows)[:, :width],
                                 token_slots[:total], max(plan.max_query_len, 1), max_len,
                                 query_lens_host=plan.query_lens, seq_lens_host=plan.seq_lens)
        return forward(self.model_cfg, self.weights, self.attn, self.attn.plan(meta), self.rope, tokens[:total],
                       token_positions[:total], self._all_reduce, self.ops)

    def _chunk_side_effects(self, plan: ChunkPlan, lanes: int, hidden, tokens, targets, output_counts, prompt_seen,
                            prompt_lp_values, prompt_lp_ids) -> None:
        """Penalty state from the chunks' ids (prompt part: seen; past prompt_len: output counts),
        and prompt log-probabilities for the chunks that asked."""
        for row, first, in_prompt, in_output in plan.penalized:
            ids = tokens[lanes + first:lanes + first + in_prompt + in_output]
            if in_prompt:
                prompt_seen[row, ids[:in_prompt]] = 1.0
            if in_output:
                output_counts[row].index_add_(0, ids[in_prompt:], torch.ones(in_output, dtype=output_counts.dtype,
                                                                              device=ids.device))
        taken = 0
        for first, count, _, top in plan.prompt_asks:
            self._prompt_logprobs(hidden[lanes + first:lanes + first + count], targets[taken:taken + count], first,
                                  top, prompt_lp_values, prompt_lp_ids)
            taken += count

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, first: int, top: int,
                         values: torch.Tensor, top_ids: torch.Tensor) -> None:
        """Log-probabilities of the raw logits at `hidden`'s positions, of each next prompt token
        (`targets`) and the `top` most likely, into rows first.. of `values` / `top_ids`,
        PROMPT_LOGPROB_ROWS positions at a time."""
        for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            z = min(a + PROMPT_LOGPROB_ROWS, len(targets))
            logprobs = final_logits(self.weights, hidden[a:z], ops=self.ops).log_softmax(dim=-1)
            values[first + a:first + z, 0] = logprobs.gather(1, targets[a:z, None]).squeeze(1)
            if top:
                best = logprobs.topk(top, dim=-1)
                values[first + a:first + z, 1:1 + top] = best.values
                top_ids[first + a:first + z, :top] = best.indices

    def _load_full_state(self, fs: FullState) -> None:
        """copy_policy="always": overwrite every decode input from the host, as older systems did,
        sampling parameters included (the output token counts are device state, kept)."""
        for name in ("positions", "active", "block_table", "slot_mapping", "temperature", "top_p", "top_k",
                     "seed_keys", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            self.state[name].copy_(self._h2d(getattr(fs, name)))
        has_stops = (fs.stop_ids >= 0).any(axis=1)
        min_pos = np.where(has_stops & (fs.min_tokens > 0), fs.prompt_lens - 1 + fs.min_tokens, 0).astype(np.int64)
        self.state["min_pos"].copy_(self._h2d(min_pos))
        stop_mask = self.state["stop_mask"]
        stop_mask.zero_()
        rows, cols = np.nonzero(fs.stop_ids >= 0)
        if rows.size:
            flat = rows.astype(np.int64) * stop_mask.shape[1] + fs.stop_ids[rows, cols]
            stop_mask.view(-1)[self._h2d(flat)] = True
        self._positions[:] = fs.positions
        self._active[:] = fs.active
        self._temperature[:] = fs.temperature
        self._filtered[:] = (fs.top_k > 0) | (fs.top_p < 1)
        self._min_p[:] = fs.min_p
        self._penalized[:] = (fs.presence_penalty != 0) | (fs.frequency_penalty != 0) | (fs.repetition_penalty != 1)
        self._min_pos[:] = min_pos
        self._logprobs[:] = fs.logprobs
        self._rows_changed()

    def _warm_up(self) -> None:
        """Steps through every code path (a prefill with every optional sampling stage, a mixed
        step of a chunk beside a decoding row, then plain ones), then back to an empty batch."""
        b = self.cfg.max_batch_size
        out = torch.zeros(b, dtype=torch.int32)
        outputs = StepOutputs.allocate(b, 2)
        staging = np.zeros(2, np.int32)
        plen = 2 if self.cfg.max_seq_len > 2 else 1  # two tokens: one prompt log-probability to compute
        page = np.arange(1, 1 + -(-plen // self.cfg.page_size), dtype=np.int32)
        common = dict(prompt_len=plen, temperature=1.0, top_p=0.9, top_k=5, seed=0)
        every = Admit(row=0, **common, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.2, min_tokens=2, stop_ids=np.array([0], np.int32), logprobs=MAX_LOGPROBS,
                      prompt_logprobs=MAX_LOGPROBS)
        step = 0
        for admit in (every, Admit(row=0, **common)):
            self.execute(prefill_command(step, [(admit, page, 0)]), staging, out, outputs)
            if b > 1:  # a second row prefills while the first decodes
                other = replace(admit, row=1)
                self.execute(prefill_command(step + 1, [(other, page, 0)]), staging, out, outputs)
            self.execute(Command(step=step + 2), staging, out, outputs)
            self.finish_rows(list(range(min(b, 2))))
            step += 3
        if self._pending_graphs is not None:  # every row idle: the captures write to the scratch page only
            self._capture_graphs(self._pending_graphs)
        self.reset()

    @torch.inference_mode()
    def time_steps(self, prefill_tokens: int, steps: int, budget_s: float) -> tuple[float, float]:
        """Wall times of a prefill step of about `prefill_tokens` tokens (every row's prompt, of
        equal lengths) and the median of the greedy decode steps that follow with every row
        active, after one untimed one: at most `steps` of them, fewer once `budget_s` is spent
        (at least one). The rows share their pages: the cache's contents do not matter here.
        Leaves an empty batch, and its rows' tables and K/V until reset()."""
        cfg, b = self.cfg, self.cfg.max_batch_size
        steps = max(1, min(steps, cfg.max_seq_len - 3))
        longest = cfg.reachable_positions
        if longest < 3:
            raise ValueError("time_steps needs a cache of at least 3 positions per row")
        plen = max(1, min(prefill_tokens // b, cfg.prefill_capacity // b, longest - steps - 1))
        steps = max(1, min(steps, longest - plen - 1))
        out = torch.zeros(b, dtype=torch.int32)
        outputs = StepOutputs.allocate(b, 1)
        staging = np.zeros(b * plen, np.int32)
        pages = np.arange(1, 1 + -(-(plen + steps + 1) // cfg.page_size), dtype=np.int32)
        admits = [(Admit(row=r, prompt_len=plen, temperature=0.0, top_p=1.0, top_k=0, seed=0), pages, r * plen)
                  for r in range(b)]
        t0 = time.perf_counter()
        self.execute(prefill_command(0, admits), staging, out, outputs)
        prefill_s = time.perf_counter() - t0
        self.execute(Command(step=1), staging, out, outputs)
        times: list[float] = []
        deadline = time.perf_counter() + budget_s
        for step in range(2, 2 + steps):
            t0 = time.perf_counter()
            self.execute(Command(step=step), staging, out, outputs)
            times.append(time.perf_counter() - t0)
            if t0 > deadline:
                break
        self.finish_rows(list(range(b)))
        return prefill_s, float(np.median(times))

    @torch.inference_mode()
    def reset(self) -> None:
        """With no row active: every row's tables and the KV cache zeroed, as warm-up leaves them."""
        for name in ("block_table", "output_counts", "prompt_seen", "stop_mask", "kv_cache"):
            self.state[name].zero_()
        self.attn.invalidate()

    def _capture_graphs(self, graphs: DecodeGraphs) -> None:
        """One graph per lane bucket, the largest first (the smaller ones reuse its memory). Every
        row is idle here, so the runs made while capturing write only to the scratch page."""
        for lanes in sorted(self._lane_views, reverse=True):
            graphs.capture(lanes, partial(self._decode_logits, self._lane_views[lanes], "compute", self.cfg.max_seq_len,
                                          None))
        self.graphs, self._pending_graphs = graphs, None
