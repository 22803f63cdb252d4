"""The chip runtime: one device's model, KV cache, pooled step tensors and the step contract.

It runs in-process (tests, the benchmark floor) or inside a chip-child. `execute` applies one
command: finished rows, new page triples and admitted rows are the only inputs that cross from
the host; positions advance, slot mappings are computed and next tokens are sampled on the device.
The one host synchronisation of a decode step is the copy of the sampled ids into `out`.

Optional sampling stages (penalties, min_p, the min_tokens stop-id mask, log-probabilities) run
only in steps where some active row uses them, decided from host facts kept between admissions:
a batch that uses none runs exactly the plain sampler. Their per-row state (output token counts,
prompt tokens, stop ids) is set at admission and updated on the device from the sampled ids.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from chip_child.device import DeviceTimer, default_cpu_threads, resolve_device
from chip_child.loader import ModelConfig, load_config, load_weights, resolve_dtype
from chip_child.model import (
    PagedKV,
    Qwen3Weights,
    decode_forward,
    final_logits,
    prefill_forward,
    rope_table,
    shard_config,
)
from chip_child.pool import TaskArg, TensorPool
from chip_child.protocol import MAX_LOGPROBS, Admit, Command, FullState, Limits
from chip_child.sampling import Features, RowParams, sample, sample_with_features, seed_key, vocab_hash

COPY_POLICIES = ("dirty", "always")
STATE = "state"  # pool owner of the tensors prefill and decode share
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose [rows, vocab] logits exist at once


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
    max_prefill_tokens: int | None = None  # None: max(max_seq_len, 2048)
    copy_policy: str = "dirty"
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


class ChipRuntime:
    # Inference mode throughout: tensors without autograd bookkeeping make each small op cheaper,
    # which is most of a decode step's cost on the cpu.
    @torch.inference_mode()
    def __init__(self, cfg: RuntimeConfig):
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
        mc = self.model_cfg
        self.rope = rope_table(mc, cfg.max_seq_len, self.dtype, self.device)
        self.limits = replace(cfg.limits(), vocab_size=mc.vocab_size)
        self.pool = TensorPool(self.device)
        self._callables = {"prefill": self._prefill, "decode": self._decode}
        self._h2d_copies = 0
        self._h2d_bytes = 0
        self._timer = DeviceTimer(self.device)

        b, mb, v = cfg.max_batch_size, cfg.max_blocks_per_row, mc.vocab_size
        kv_shape = (mc.num_layers, 2, mc.num_kv_heads, cfg.total_pages, cfg.page_size, mc.head_dim)
        i64, f32 = torch.int64, torch.float32
        state = lambda slot, shape, dtype, role: TaskArg(slot, shape, dtype, role, owner=STATE)  # noqa: E731
        shared = (
            state("kv_cache", kv_shape, self.dtype, "inout"),
            state("input_ids", (b,), i64, "inout"),
            state("positions", (b,), i64, "inout"),
            state("active", (b,), torch.bool, "in"),
            state("block_table", (b, mb), i64, "in"),
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
            state("prompt_seen", (b, v), f32, "in"),  # 1.0 / 0.0: float arithmetic is faster than bool
            state("stop_mask", (b, v), torch.bool, "in"),
            state("lp_values", (b, 1 + MAX_LOGPROBS), f32, "out"),
            state("lp_ids", (b, MAX_LOGPROBS), i64, "out"),
        )
        # The gather target of decode attention: one layer's K and V pages of every row at full length.
        workspace = (2, mc.num_kv_heads, b * mb, cfg.page_size, mc.head_dim)
        self.decode_args = shared + (TaskArg("slot_mapping", (b,), i64, "inout"),
                                     TaskArg("kv_workspace", workspace, self.dtype, "inout"))
        p = cfg.prefill_capacity
        self.prefill_args = shared + (
            TaskArg("tokens", (p,), i64, "in"),
            TaskArg("prompt_positions", (p,), i64, "in"),
            TaskArg("prompt_slots", (p,), i64, "in"),
            TaskArg("last_index", (b,), i64, "in"),
            TaskArg("rows", (b,), i64, "in"),
            TaskArg("prompt_lp_values", (p, 1 + MAX_LOGPROBS), f32, "out"),
            TaskArg("prompt_lp_ids", (p, MAX_LOGPROBS), i64, "out"),
        )
        self.state = self.pool.resolve("decode", self.decode_args)  # the decode step's tensors, by slot
        self.prefill_state = self.pool.resolve("prefill", self.prefill_args)
        self.state["vocab_keys"].copy_(vocab_hash(v, self.device))
        self.kv = PagedKV(self.state["kv_cache"], self.state["kv_workspace"])

        # Host mirrors of per-row facts the child needs without reading the device.
        self._positions = np.zeros(b, np.int64)
        self._active = np.zeros(b, bool)
        self._temperature = np.zeros(b, np.float32)
        self._filtered = np.zeros(b, bool)
        self._min_p = np.zeros(b, np.float32)
        self._penalized = np.zeros(b, bool)
        self._min_pos = np.zeros(b, np.int64)
        self._logprobs = np.full(b, -1, np.int64)
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
        """Frees the pooled tensors and leaves the process group."""
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
    @torch.inference_mode()
    def execute(self, cmd: Command, staging: np.ndarray, out: torch.Tensor,
                outputs: StepOutputs | None = None) -> StepResult:
        """Applies one validated command and writes the sampled id of every row into `out` [B],
        and, when `outputs` is given and some row asked, log-probabilities into it (see
        StepOutputs; without `outputs` none are computed). A step that raises leaves host and
        device state out of step with each other: a chip-child refuses every later command, and
        an in-process user must build a new runtime."""
        t0 = time.perf_counter()
        copies0, bytes0, allocs0 = self._h2d_copies, self._h2d_bytes, self.pool.allocations
        if cmd.finished_rows:
            self.finish_rows(cmd.finished_rows)
        if len(cmd.new_pages):
            rows, blocks, pages = self._h2d(cmd.new_pages.astype(np.int64)).unbind(1)
            self.state["block_table"][rows, blocks] = pages
            self._slot_steps = 0  # a row's current page may have changed: recompute its slot
        self._timer.start()
        prompt_asks = ()
        if cmd.is_prefill:
            n, prompt_asks = self._run_prefill(cmd, staging, outputs is not None)
        else:
            if cmd.full_state is not None:
                self._load_full_state(cmd.full_state)
            n = self._run_decode(cmd.full_state is None, outputs is not None)
        self._timer.stop()
        out.copy_(self.state["input_ids"])  # the sampled ids: the step's only synchronisation
        if n >= 0:
            outputs.logprobs[:, :1 + n].copy_(self.state["lp_values"][:, :1 + n])
            outputs.logprob_ids[:, :n].copy_(self.state["lp_ids"][:, :n])
        if prompt_asks:
            values, ids = self.prefill_state["prompt_lp_values"], self.prefill_state["prompt_lp_ids"]
            for start, length, offset, top in prompt_asks:
                src, dst = slice(start, start + length - 1), slice(offset, offset + length - 1)
                outputs.prompt_logprobs[dst, :1 + top].copy_(values[src, :1 + top])
                outputs.prompt_logprob_ids[dst, :top].copy_(ids[src, :top])
        return StepResult(
            apply_s=time.perf_counter() - t0,
            device_s=self._timer.elapsed_s(),
            h2d_copies=self._h2d_copies - copies0,
            h2d_bytes=self._h2d_bytes - bytes0,
            pool_allocs=self.pool.allocations - allocs0,
            logprobs=n,
            prompt_logprobs=bool(prompt_asks),
        )

    @property
    def logits(self) -> torch.Tensor:
        """Last step's fp32 logits per row (prefill fills the admitted rows only)."""
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
            if live.size:
                facts.any_penalty = bool(self._penalized[act].any())
                facts.any_min_p = bool((random & (self._min_p[act] > 0)).any())
                facts.mask_steps = max(0, int((self._min_pos[act] - live).max()))
                facts.logprobs = int(self._logprobs[act].max())
            facts.update_plain()
            self._batch_facts = facts
        return self._batch_facts

    def _step_features(self, facts: BatchFacts, want_logprobs: bool) -> Features | None:
        """This decode step's optional stages; None when it runs the plain sampler."""
        mask = facts.mask_steps > 0
        if mask:
            facts.mask_steps -= 1
            if not facts.mask_steps:
                facts.update_plain()
        logprobs = facts.logprobs if want_logprobs else -1
        if not (facts.any_penalty or facts.any_min_p or mask or logprobs >= 0):
            return None
        return Features(facts.any_penalty, facts.any_min_p, mask, logprobs)

    def _run_decode(self, compute_slots: bool, want_logprobs: bool) -> int:
        """Returns N of the log-probabilities the step computed (-1: none)."""
        facts = self._facts()
        features = None if facts.plain else self._step_features(facts, want_logprobs)
        if facts.furthest >= self.cfg.max_seq_len:
            raise ValueError(f"a row would pass max_seq_len={self.cfg.max_seq_len}: the parent sent a step too many")
        page = self.cfg.page_size
        if not compute_slots:
            slots = "given"
        elif self._slot_steps > 0:
            slots = "advance"
            self._slot_steps -= 1
        else:
            slots = "compute"
            # Every active row stays on its current page for this many more steps.
            live = self._positions[self._active]
            self._slot_steps = int((page - 1 - live % page).min()) if live.size else 0
        self.submit_next_level("decode", self.decode_args, num_blocks=facts.furthest // page + 1,
                               any_random=facts.any_random, any_filter=facts.any_filter, slots=slots,
                               features=features)
        self._positions += self._active
        facts.furthest += facts.any_active
        return -1 if features is None else features.logprobs

    def _decode(self, *, kv_cache, kv_workspace, input_ids, positions, active, block_table, slot_mapping,
                temperature, top_p, top_k, seed_keys, vocab_keys, logits, min_p, presence_penalty,
                frequency_penalty, repetition_penalty, min_pos, output_counts, prompt_seen, stop_mask, lp_values,
                lp_ids, num_blocks: int, any_random: bool, any_filter: bool, slots: str,
                features: Features | None) -> None:
        page = self.cfg.page_size
        if slots == "compute":
            blocks = block_table.gather(1, (positions // page)[:, None]).squeeze(1)
            # Idle rows write to slot 0 of the scratch page, never into a page another row owns.
            torch.mul(blocks * page + positions % page, active, out=slot_mapping)
        elif slots == "advance":
            slot_mapping.add_(active)  # no active row crosses a page boundary this step
        decode_forward(self.model_cfg, self.weights, self.kv, self.rope, input_ids, positions, slot_mapping,
                       block_table[:, :num_blocks], logits, self._all_reduce)
        # Idle rows' ids are never read: the parent ignores them and an admission overwrites them.
        if features is None:
            input_ids.copy_(sample(logits, temperature, top_k, top_p, seed_keys, positions, vocab_keys, any_random,
                                   any_filter))
        else:
            params = RowParams(temperature, top_k, top_p, seed_keys, min_p, presence_penalty, frequency_penalty,
                               repetition_penalty, min_pos, output_counts, prompt_seen, stop_mask)
            input_ids.copy_(sample_with_features(logits, params, positions, vocab_keys, any_random, any_filter,
                                                 features, lp_values, lp_ids))
            if features.penalties:  # the sampled ids join their rows' outputs, on the device
                output_counts.scatter_add_(1, input_ids[:, None], active[:, None].to(output_counts.dtype))
        positions.add_(active)

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

    def _run_prefill(self, cmd: Command, staging: np.ndarray,
                     want_logprobs: bool) -> tuple[int, list[tuple[int, int, int, int]]]:
        """Returns N of the per-row log-probabilities computed (-1: none) and, for each admit whose
        prompt log-probabilities were computed, (packed start, prompt_len, staging offset, N)."""
        admits = cmd.admits
        page = self.cfg.page_size
        lens = [a.prompt_len for a in admits]
        starts = np.cumsum([0] + lens[:-1]).tolist()
        total = sum(lens)
        tokens = np.concatenate([staging[a.staging_offset:a.staging_offset + a.prompt_len] for a in admits])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        slots = np.concatenate([a.pages.astype(np.int64)[np.arange(n) // page] * page + np.arange(n) % page
                                for a, n in zip(admits, lens)])
        rows = np.array([a.row for a in admits], np.int64)
        table = np.zeros((len(admits), self.cfg.max_blocks_per_row), np.int64)
        for i, a in enumerate(admits):
            table[i, :len(a.pages)] = a.pages
        floats = np.array([[a.temperature, a.top_p, a.min_p, a.presence_penalty, a.frequency_penalty,
                            a.repetition_penalty] for a in admits], np.float32)
        # Stop ids are masked while the input position is below min_pos: never for a row without them.
        stops = [np.asarray(a.stop_ids, np.int64) if a.min_tokens > 0 else np.zeros(0, np.int64) for a in admits]
        min_pos = np.array([a.prompt_len - 1 + a.min_tokens if s.size else 0 for a, s in zip(admits, stops)],
                           np.int64)
        ints = np.stack([np.array([a.top_k for a in admits], np.int64),
                         np.array([seed_key(a.seed) for a in admits], np.int64), min_pos], axis=1)
        penalized = np.array([a.uses_penalties for a in admits], bool)

        n = len(admits)
        t = self.pool.resolve("prefill", self.prefill_args)
        t["tokens"][:total].copy_(self._h2d(tokens.astype(np.int64)))
        t["prompt_positions"][:total].copy_(self._h2d(positions))
        t["prompt_slots"][:total].copy_(self._h2d(slots))
        t["last_index"][:n].copy_(self._h2d(np.cumsum(lens) - 1))
        t["rows"][:n].copy_(self._h2d(rows))
        idx = t["rows"][:n]
        self.state["block_table"][idx] = self._h2d(table)
        dev_floats = self._h2d(floats)
        for j, name in enumerate(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty")):
            self.state[name][idx] = dev_floats[:, j]
        dev_ints = self._h2d(ints)
        for j, name in enumerate(("top_k", "seed_keys", "min_pos")):
            self.state[name][idx] = dev_ints[:, j]
        # Per-row state of the optional stages, only for the rows that use them.
        vocab = self.model_cfg.vocab_size
        for a, start, uses in zip(admits, starts, penalized):
            if uses:
                self.state["output_counts"][a.row].zero_()
                seen = self.state["prompt_seen"][a.row]
                seen.zero_()
                seen[t["tokens"][start:start + a.prompt_len]] = 1.0
        if min_pos.any():
            for a, m in zip(admits, min_pos):
                if m:
                    self.state["stop_mask"][a.row].zero_()
            flat = np.concatenate([a.row * vocab + s for a, s in zip(admits, stops)])
            self.state["stop_mask"].view(-1)[self._h2d(flat)] = True

        self._active[rows] = True
        self._positions[rows] = lens
        self._temperature[rows] = floats[:, 0]
        self._filtered[rows] = (ints[:, 0] > 0) | (floats[:, 1] < 1)
        self._min_p[rows] = floats[:, 2]
        self._penalized[rows] = penalized
        self._min_pos[rows] = min_pos
        self._logprobs[rows] = [a.logprobs for a in admits]
        self._rows_changed()
        facts = self._facts()

        # The admitted rows' own stages: their first token is generated token 0.
        logprobs = max(a.logprobs for a in admits) if want_logprobs else -1
        features = Features(bool(penalized.any()), bool(((floats[:, 0] > 0) & (floats[:, 2] > 0)).any()),
                            bool(min_pos.any()), logprobs)
        if features == Features():
            features = None
        asks = [(start, a.prompt_len, a.staging_offset, a.prompt_logprobs) for a, start in zip(admits, starts)
                if want_logprobs and a.prompt_logprobs >= 0 and a.prompt_len > 1]
        self.submit_next_level("prefill", self.prefill_args, num_tokens=total, num_rows=n, prompt_lens=lens,
                               any_random=facts.any_random, any_filter=facts.any_filter, features=features,
                               prompt_asks=[(start, length, top) for start, length, _, top in asks])
        return -1 if features is None else features.logprobs, asks

    def _prefill(self, *, kv_cache, input_ids, positions, active, block_table, temperature, top_p, top_k,
                 seed_keys, vocab_keys, logits, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                 min_pos, output_counts, prompt_seen, stop_mask, lp_values, lp_ids, tokens, prompt_positions,
                 prompt_slots, last_index, rows, prompt_lp_values, prompt_lp_ids, num_tokens: int, num_rows: int,
                 prompt_lens: list[int], any_random: bool, any_filter: bool, features: Features | None,
                 prompt_asks: list[tuple[int, int, int]]) -> None:
        idx = rows[:num_rows]
        pos = prompt_positions[:num_tokens]
        row_logits = prefill_forward(self.model_cfg, self.weights, self.kv, self.rope, tokens[:num_tokens], pos,
                                     prompt_slots[:num_tokens], prompt_lens, last_index[:num_rows],
                                     self._all_reduce, return_hidden=bool(prompt_asks))
        if prompt_asks:
            row_logits, hidden = row_logits
        logits[idx] = row_logits
        counters = pos[last_index[:num_rows]]
        if features is None:
            ids = sample(row_logits, temperature[idx], top_k[idx], top_p[idx], seed_keys[idx], counters, vocab_keys,
                         any_random, any_filter)
        else:
            params = RowParams(temperature, top_k, top_p, seed_keys, min_p, presence_penalty, frequency_penalty,
                               repetition_penalty, min_pos, output_counts, prompt_seen, stop_mask).select(idx)
            values = top_ids = None
            if features.logprobs >= 0:
                values = lp_values.new_empty((num_rows, lp_values.shape[1]))
                top_ids = lp_ids.new_empty((num_rows, lp_ids.shape[1]))
            ids = sample_with_features(row_logits, params, counters, vocab_keys, any_random, any_filter, features,
                                       values, top_ids)
            if features.logprobs >= 0:
                lp_values[idx] = values
                lp_ids[idx] = top_ids
            if features.penalties:  # generated token 0 is the first of the row's output
                output_counts.index_put_((idx, ids), torch.ones_like(ids, dtype=output_counts.dtype),
                                         accumulate=True)
        input_ids[idx] = ids
        positions[idx] = counters + 1
        active[idx] = True
        for start, length, top in prompt_asks:
            self._prompt_logprobs(hidden, tokens, start, length, top, prompt_lp_values, prompt_lp_ids)

    def _prompt_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, length: int, top: int,
                         values: torch.Tensor, top_ids: torch.Tensor) -> None:
        """Log-probabilities of the raw logits at the prompt's positions 0..length-2: row start + i
        gets token i + 1's value and the `top` most likely, PROMPT_LOGPROB_ROWS positions at a time."""
        end = start + length - 1
        for a in range(start, end, PROMPT_LOGPROB_ROWS):
            b = min(a + PROMPT_LOGPROB_ROWS, end)
            logprobs = final_logits(self.weights, hidden[a:b]).log_softmax(dim=-1)
            values[a:b, 0] = logprobs.gather(1, tokens[a + 1:b + 1, None]).squeeze(1)
            if top:
                best = logprobs.topk(top, dim=-1)
                values[a:b, 1:1 + top] = best.values
                top_ids[a:b, :top] = best.indices

    def _warm_up(self) -> None:
        """A prefill and a decode step through every code path (every optional sampling stage,
        then none), then back to an empty batch."""
        b = self.cfg.max_batch_size
        out = torch.zeros(b, dtype=torch.int32)
        outputs = StepOutputs.allocate(b, 1)
        staging = np.zeros(1, np.int32)
        # One prompt token on one page; the decode step's block, if beyond it, is the scratch page.
        common = dict(row=0, prompt_len=1, staging_offset=0, pages=np.array([1], np.int32), temperature=1.0,
                      top_p=0.9, top_k=5, seed=0)
        every = Admit(**common, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                      min_tokens=2, stop_ids=np.array([0], np.int32), logprobs=MAX_LOGPROBS,
                      prompt_logprobs=MAX_LOGPROBS)
        for step, admit in enumerate((every, Admit(**common))):
            self.execute(Command(step=2 * step, admits=[admit]), staging, out, outputs)
            self.execute(Command(step=2 * step + 1), staging, out, outputs)
            self.finish_rows([0])
        for name in ("block_table", "output_counts", "prompt_seen", "stop_mask"):
            self.state[name].zero_()
        self.kv.cache.zero_()
