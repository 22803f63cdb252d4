"""The chip runtime: one device's model, KV cache, pooled step tensors and the step contract.

It runs in-process (tests, the benchmark floor) or inside a chip-child. `execute` applies one
command: finished rows, new page triples and admitted rows are the only inputs that cross from
the host; positions advance, slot mappings are computed and next tokens are sampled on the device.
The one host synchronisation of a decode step is the copy of the sampled ids into `out`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from chip_child.device import DeviceTimer, default_cpu_threads, resolve_device
from chip_child.loader import ModelConfig, load_config, load_weights, resolve_dtype
from chip_child.model import PagedKV, Qwen3Weights, decode_forward, prefill_forward, rope_table, shard_config
from chip_child.pool import TaskArg, TensorPool
from chip_child.protocol import Command, FullState, Limits
from chip_child.sampling import sample, seed_key, vocab_hash

COPY_POLICIES = ("dirty", "always")
STATE = "state"  # pool owner of the tensors prefill and decode share


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


@dataclass
class StepResult:
    apply_s: float
    device_s: float
    h2d_copies: int
    h2d_bytes: int
    pool_allocs: int


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
        self.limits = cfg.limits()
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
        )
        self.state = self.pool.resolve("decode", self.decode_args)  # the decode step's tensors, by slot
        self.pool.resolve("prefill", self.prefill_args)
        self.state["vocab_keys"].copy_(vocab_hash(v, self.device))
        self.kv = PagedKV(self.state["kv_cache"], self.state["kv_workspace"])

        # Host mirrors of per-row facts the child needs without reading the device.
        self._positions = np.zeros(b, np.int64)
        self._active = np.zeros(b, bool)
        self._temperature = np.zeros(b, np.float32)
        self._filtered = np.zeros(b, bool)
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
    def execute(self, cmd: Command, staging: np.ndarray, out: torch.Tensor) -> StepResult:
        """Applies one validated command and writes the sampled id of every row into `out` [B].
        A step that raises leaves host and device state out of step with each other: a chip-child
        refuses every later command, and an in-process user must build a new runtime."""
        t0 = time.perf_counter()
        copies0, bytes0, allocs0 = self._h2d_copies, self._h2d_bytes, self.pool.allocations
        if cmd.finished_rows:
            self.finish_rows(cmd.finished_rows)
        if len(cmd.new_pages):
            rows, blocks, pages = self._h2d(cmd.new_pages.astype(np.int64)).unbind(1)
            self.state["block_table"][rows, blocks] = pages
            self._slot_steps = 0  # a row's current page may have changed: recompute its slot
        self._timer.start()
        if cmd.is_prefill:
            self._run_prefill(cmd, staging)
        else:
            if cmd.full_state is not None:
                self._load_full_state(cmd.full_state)
            self._run_decode(compute_slots=cmd.full_state is None)
        self._timer.stop()
        out.copy_(self.state["input_ids"])  # the sampled ids: the step's only synchronisation
        return StepResult(
            apply_s=time.perf_counter() - t0,
            device_s=self._timer.elapsed_s(),
            h2d_copies=self._h2d_copies - copies0,
            h2d_bytes=self._h2d_bytes - bytes0,
            pool_allocs=self.pool.allocations - allocs0,
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
            live = self._positions[self._active]
            self._batch_facts = BatchFacts(int(live.max()) if live.size else 0,
                                           bool((self._temperature[self._active] > 0).any()),
                                           bool(self._filtered[self._active].any()), bool(live.size))
        return self._batch_facts

    def _run_decode(self, compute_slots: bool) -> None:
        facts = self._facts()
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
                               any_random=facts.any_random, any_filter=facts.any_filter, slots=slots)
        self._positions += self._active
        facts.furthest += facts.any_active

    def _decode(self, *, kv_cache, kv_workspace, input_ids, positions, active, block_table, slot_mapping,
                temperature, top_p, top_k, seed_keys, vocab_keys, logits, num_blocks: int, any_random: bool,
                any_filter: bool, slots: str) -> None:
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
        input_ids.copy_(sample(logits, temperature, top_k, top_p, seed_keys, positions, vocab_keys, any_random,
                               any_filter))
        positions.add_(active)

    def _load_full_state(self, fs: FullState) -> None:
        """copy_policy="always": overwrite every decode input from the host, as older systems did."""
        for name in ("positions", "active", "block_table", "slot_mapping", "temperature", "top_p", "top_k",
                     "seed_keys"):
            self.state[name].copy_(self._h2d(getattr(fs, name)))
        self._positions[:] = fs.positions
        self._active[:] = fs.active
        self._temperature[:] = fs.temperature
        self._filtered[:] = (fs.top_k > 0) | (fs.top_p < 1)
        self._rows_changed()

    def _run_prefill(self, cmd: Command, staging: np.ndarray) -> None:
        admits = cmd.admits
        page = self.cfg.page_size
        lens = [a.prompt_len for a in admits]
        total = sum(lens)
        tokens = np.concatenate([staging[a.staging_offset:a.staging_offset + a.prompt_len] for a in admits])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        slots = np.concatenate([a.pages.astype(np.int64)[np.arange(n) // page] * page + np.arange(n) % page
                                for a, n in zip(admits, lens)])
        rows = np.array([a.row for a in admits], np.int64)
        table = np.zeros((len(admits), self.cfg.max_blocks_per_row), np.int64)
        for i, a in enumerate(admits):
            table[i, :len(a.pages)] = a.pages
        seeds = np.array([seed_key(a.seed) for a in admits], np.int64)
        params = np.array([[a.temperature, a.top_p] for a in admits], np.float32)
        top_k = np.array([a.top_k for a in admits], np.int64)

        n = len(admits)
        t = self.pool.resolve("prefill", self.prefill_args)
        t["tokens"][:total].copy_(self._h2d(tokens.astype(np.int64)))
        t["prompt_positions"][:total].copy_(self._h2d(positions))
        t["prompt_slots"][:total].copy_(self._h2d(slots))
        t["last_index"][:n].copy_(self._h2d(np.cumsum(lens) - 1))
        t["rows"][:n].copy_(self._h2d(rows))
        idx = t["rows"][:n]
        self.state["block_table"][idx] = self._h2d(table)
        self.state["temperature"][idx] = self._h2d(params[:, 0])
        self.state["top_p"][idx] = self._h2d(params[:, 1])
        self.state["top_k"][idx] = self._h2d(top_k)
        self.state["seed_keys"][idx] = self._h2d(seeds)

        self._active[rows] = True
        self._positions[rows] = lens
        self._temperature[rows] = params[:, 0]
        self._filtered[rows] = (top_k > 0) | (params[:, 1] < 1)
        self._rows_changed()
        facts = self._facts()
        self.submit_next_level("prefill", self.prefill_args, num_tokens=total, num_rows=n, prompt_lens=lens,
                               any_random=facts.any_random, any_filter=facts.any_filter)

    def _prefill(self, *, kv_cache, input_ids, positions, active, block_table, temperature, top_p, top_k,
                 seed_keys, vocab_keys, logits, tokens, prompt_positions, prompt_slots, last_index, rows,
                 num_tokens: int, num_rows: int, prompt_lens: list[int], any_random: bool,
                 any_filter: bool) -> None:
        idx = rows[:num_rows]
        pos = prompt_positions[:num_tokens]
        row_logits = prefill_forward(self.model_cfg, self.weights, self.kv, self.rope, tokens[:num_tokens], pos,
                                     prompt_slots[:num_tokens], prompt_lens, last_index[:num_rows],
                                     self._all_reduce)
        logits[idx] = row_logits
        counters = pos[last_index[:num_rows]]
        ids = sample(row_logits, temperature[idx], top_k[idx], top_p[idx], seed_keys[idx], counters, vocab_keys,
                     any_random, any_filter)
        input_ids[idx] = ids
        positions[idx] = counters + 1
        active[idx] = True

    def _warm_up(self) -> None:
        """One prefill and one decode through every code path, then back to an empty batch."""
        from chip_child.protocol import Admit

        b = self.cfg.max_batch_size
        out = torch.zeros(b, dtype=torch.int32)
        staging = np.zeros(1, np.int32)
        # One prompt token on one page; the decode step's block, if beyond it, is the scratch page.
        admit = Admit(row=0, prompt_len=1, staging_offset=0, pages=np.array([1], np.int32), temperature=1.0,
                      top_p=0.9, top_k=5, seed=0)
        self.execute(Command(step=0, admits=[admit]), staging, out)
        self.execute(Command(step=1), staging, out)
        self.finish_rows([0])
        self.state["block_table"].zero_()
        self.kv.cache.zero_()
