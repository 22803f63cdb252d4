"""The chip runtime: one device's model, KV cache, pooled step tensors and the step contract.

It runs in-process (tests, the benchmark floor) or inside a chip-child. `execute` applies one
command: finished rows, rows set up, new page triples and prompt chunks are the only inputs from
the host; positions advance, slot mappings are computed and next tokens are sampled on the
device. A decode step's one host synchronisation is the copy of the sampled ids into `out`.

Every step is one forward over a packed token axis: the decode lanes first (a lane whose row is
not decoding writes to the scratch page and its token is ignored), then each prompt chunk's
tokens; a chunk that ends its prompt hands its last hidden state to its row's lane, so one
sampler call serves both. A step runs lanes [0, n), n the lane bucket of its highest active row
(chip_child.step.graphs), fewer in the forward of a step with chunks (chunk_layout.plan_chunks)
and of a cpu decode step (the active lanes alone: live_lanes). A decode-only step's forward is a
replayed graph per bucket on cuda and npu, one C call for every layer in bf16 on the cpu
(chip_child.cpu_kernels.decode_layers); on cuda the elementwise stages are fused Triton kernels.

Optional sampling stages (a grammar's token mask, penalties, min_p, the min_tokens stop-id mask,
log-probabilities) run only in steps where some active row uses them, decided from host facts
kept between admissions; their state is set at admission and updated on the device from the
sampled ids (a grammar's matcher on the host: chip_child.sampling.grammar_rows).

With speculation (chip_child.spec.speculation), a decode-only step where some row has drafts runs
the "verify" callable instead: each row moves on by 1 to k + 1 tokens.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from chip_child.attention import AttentionMetadata, AttentionSpec, cache_dtype_of, get_backend
from chip_child.attention.self_check import checked_backend
from chip_child.config import COPY_POLICIES, RuntimeConfig
from chip_child.device import DeviceTimer, default_cpu_threads, resolve_device, tensor_parallel_all_reduce
from chip_child.step.sleep import owned_storage
from chip_child.step.graphs import Capturer, DecodeGraphs, DeviceGraphs, bucket_of, resolve_decode_graphs
from chip_child.models.fp8_linear import keeps_fp8_on
from chip_child.models.loader import ModelConfig, load_config, load_weights, resolve_dtype
from chip_child.models.fused import resolve_fused_kernels, triton_layer_ops
from chip_child.models.lora import LoraSlots
from chip_child.sampling.prompt_logprobs import prompt_logprobs
from chip_child.models.kernel_checks import KernelVerdict, check_fp8_gemms, checked_ops
from chip_child.models.moe_npu import npu_moe
from chip_child.models.qwen3 import TORCH_OPS, Qwen3Weights, final_logits, forward, rope_table, shard_config
from chip_child.step.chunk_layout import ChunkInts, ChunkPlan, lane_hidden, plan_chunks
from chip_child.sampling.grammar_rows import ConstrainedRows
from chip_child.step.pool import TaskArg, TensorPool
from chip_child.step.task_args import LANE_SLOTS, step_task_args
from chip_child.cpu_kernels.decode_layers import DecodeLayers
from chip_child.step.live_lanes import live_lanes
from chip_child.cpu_kernels.layer_ops import cpu_layer_ops
from chip_child.models.prepack import cpu_linear_kernel, resolve_cpu_prepack
from chip_child.protocol import Chunk, Command
from chip_child.step.row_state import RowState
from chip_child.sampling.noise import vocab_hash
from chip_child.sampling.sampler import Features, RowParams, sample, sample_with_features
from chip_child.spec.speculation import Speculation
from chip_child.spec.config import SpeculativeConfig
from chip_child.step.results import LaunchedStep, StepOutputs, StepResult
from chip_child.step.warmup import time_steps, warm_up


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
        full_cfg = load_config(cfg.model_dir, cfg.quantization)
        self.dtype = resolve_dtype(cfg.dtype, self.device.type, full_cfg)
        # this rank's heads and MLP slice (its experts under expert parallelism)
        self.model_cfg: ModelConfig = shard_config(full_cfg, cfg.tp_size, cfg.enable_expert_parallel)
        # its token trie builds while the weights load (waited for below)
        grammar_compiler = ConstrainedRows.compiler_for(cfg.model_dir, self.model_cfg.vocab_size,
                                                        full_cfg.eos_token_ids)
        self.all_reduce = tensor_parallel_all_reduce(self.device.type, cfg.dist_init, cfg.tp_rank, cfg.tp_size)
        # Fuse and shard on the host (memory-mapped), so only this rank's weights reach the device.
        host = load_weights(cfg.model_dir, full_cfg, self.dtype, "cpu",
                            keep_fp8=keeps_fp8_on(self.device, full_cfg.quantization))
        self.weights = Qwen3Weights.from_hf(host, full_cfg, cfg.tp_rank, cfg.tp_size,
                                            cfg.enable_expert_parallel).to(self.device)
        del host
        self.cpu_prepack = resolve_cpu_prepack(cfg.cpu_prepack, self.device.type, self.dtype)
        if self.cpu_prepack:
            self.weights.prepack()
        self.cpu_linear = cpu_linear_kernel(self.cpu_prepack, self.dtype)
        if cfg.enable_sleep_mode:  # sleep frees the weights in place: they need storage of their own
            owned_storage(self.weights)
        mc = self.model_cfg
        self.lora = LoraSlots(full_cfg, cfg.max_loras, cfg.max_lora_rank, self.dtype, self.device, cfg.tp_rank,
                              cfg.tp_size) if cfg.max_loras else None  # adapter slots beside the weights
        self.rope = rope_table(mc, cfg.max_seq_len, self.dtype, self.device)
        if resolve_fused_kernels(cfg.fused_kernels, self.device.type):
            self.ops = triton_layer_ops()
        else:  # the cpu's own kernels unless fused kernels were turned off
            on_cpu = self.device.type == "cpu" and cfg.fused_kernels is None
            self.ops = cpu_layer_ops(self.dtype) if on_cpu else TORCH_OPS
        if self.device.type == "npu":
            self.ops = replace(self.ops, moe=npu_moe)  # torch_npu's MoE ops
        self.ops, self.kernel_checks = checked_ops(self.ops, self.weights, self.rope, mc.num_heads, mc.num_kv_heads,
                                                   self.device, self.dtype)
        self.limits = replace(cfg.limits(), vocab_size=mc.vocab_size)
        self.pool = TensorPool(self.device, resizable=cfg.enable_sleep_mode)
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
        drafts = cfg.speculative["num_speculative_tokens"] if cfg.speculative else 0  # verify: b * (1 + drafts)
        spec = AttentionSpec(num_layers=mc.num_layers, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                             head_dim=mc.head_dim, num_pages=cfg.total_pages, page_size=cfg.page_size,
                             dtype=self.dtype, max_tokens=b + max(p, b * drafts), max_seqs=2 * b, max_blocks=mb,
                             cache_dtype=cache_dtype_of(cfg.kv_cache_dtype))
        backend = get_backend(self.device.type, cfg.attention_backend)
        backend, attention_check = checked_backend(backend, spec, self.device)
        graphs = resolve_decode_graphs(cfg.decode_graphs, self.device.type, backend.decode_capturable, backend.name,
                                       model_capturable=mc.moe is None)
        graphs = graphs or graph_capturer is not None
        if graphs and cfg.speculative is not None:  # a verify step is eager, and so, for now, is every step
            print("chip-child: speculative decoding runs without decode graphs", file=sys.stderr, flush=True)
            graphs = False
        # The torch backend's decode mirror keeps its books on the host: a graph would freeze them.
        options = {"decode_mirror": False} if graphs and backend.has_decode_mirror else {}
        self.attn = backend(spec, self.device, **options)
        self.kernel_checks += check_fp8_gemms(self.weights, self.device)
        if attention_check is not None:
            self.kernel_checks.append(KernelVerdict("attention", *attention_check))
        self.decode_args, self.prefill_args = step_task_args(self.attn, spec.kv_dtype, b, mb, v, p)
        self.state = self.pool.resolve("decode", self.decode_args)  # the step's shared tensors, by slot
        self.prefill_state = self.pool.resolve("prefill", self.prefill_args)
        self.attn.bind(self.state["kv_cache"], {name: self.state[f"attn_{name}"] for name in self.attn.workspace_shapes})
        self.state["vocab_keys"].copy_(vocab_hash(v, self.device))
        self.state["lane_starts"].copy_(torch.arange(b + 1, dtype=torch.int32))
        buckets = bucket_of(b).tolist()  # highest active row + 1 -> the lanes a step runs
        self.rows = RowState(self.state, self.h2d, buckets)
        # Constrained rows' masks: filled in place on the cpu, through a pinned buffer elsewhere.
        mask = self.state["grammar_mask"]
        host_mask = mask if self.device.type == "cpu" else torch.empty(mask.shape, dtype=mask.dtype, pin_memory=True)
        self.grammars = ConstrainedRows(grammar_compiler, host_mask)
        # Each bucket's views of the pooled tensors, made once: fixed addresses a graph can read.
        self.lane_views = {n: {**{slot: self.state[slot][:n] for slot in LANE_SLOTS},
                                "lane_starts": self.state["lane_starts"][:n + 1],
                                "vocab_keys": self.state["vocab_keys"]}
                            for n in sorted(set(buckets))}
        self.graphs: DecodeGraphs | None = None  # set once warm-up captured them; warm-up itself runs eagerly
        self.spec = Speculation(self, SpeculativeConfig.of(cfg.speculative)) if cfg.speculative else None
        self._pending_graphs = DecodeGraphs(graph_capturer or DeviceGraphs(self.device)) if graphs else None
        self.decode_layers = DecodeLayers.of(self)  # a decode step's layers in one call (bf16 on the cpu)
        self.pack_lanes = self.device.type == "cpu" and self.lora is None and self.spec is None  # live_lanes.py

        warm_up(self)
        if self._pending_graphs is not None:  # every row idle: the captures write to the scratch page only
            self.capture_graphs(self._pending_graphs)
        self.reset()
        self.grammars.ready()  # before any timed or served step: the build holds the interpreter lock
        self.warm_pool_allocations = self.pool.allocations
        self.setup_s = time.perf_counter() - t0

    def close(self) -> None:
        """Frees the graphs and pooled tensors and leaves the process group."""
        self.grammars.close()
        self.graphs, self.lane_views = None, {}
        self.pool.release()
        if self.cfg.tp_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def register_callable(self, name: str, fn) -> None:
        """Callables are registered before the first step; `submit_next_level` names them."""
        self._callables[name] = fn

    def submit_next_level(self, callable_name: str, task_args: tuple[TaskArg, ...], **scalars):
        """Runs a registered callable on the pooled tensors its arguments name."""
        if not torch.is_inference_mode_enabled():  # called from outside a step: the pool holds inference tensors
            with torch.inference_mode():
                return self.submit_next_level(callable_name, task_args, **scalars)
        return self._callables[callable_name](**self.pool.resolve(callable_name, task_args), **scalars)

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
            self.rows.set_up(cmd.admits)
            if self.spec is not None:
                self.spec.admitted(cmd.admits)
            for a in cmd.admits:
                if a.grammar:
                    self.grammars.admit(a.row, a.grammar, a.grammar_after, a.grammar_replay)
        if len(cmd.new_pages):
            rows, blocks, pages = self.h2d(cmd.new_pages.astype(np.int64)).unbind(1)
            self.state["block_table"][rows, blocks] = pages.to(torch.int32)
            self.rows.slot_steps = 0  # a row's current page may have changed: recompute its slot
        timer.start()
        fs = cmd.full_state
        if fs is not None:
            self.rows.load_full_state(fs)
            if self.spec is not None:  # the host's active set may hold rows already at their limit here
                self.spec.stop_finished(self.cfg.max_batch_size)
        n, plan, lanes = self._run_step(cmd.chunks, staging, fs is None or fs.slot_mapping is None,
                                        outputs is not None)
        timer.stop()
        # The sampled ids: the step's only synchronisation. Lanes [0, lanes) hold every active
        # row, the only rows the parent reads; the rest of `out` is left as it was.
        v, done = self.lane_views[lanes], None
        if self._ids_host is None:
            out[:lanes].copy_(v["input_ids"])
        else:
            host = self._ids_host[self._flip, :lanes]
            host.copy_(v["input_ids"], non_blocking=True)
            done = self._ids_events[self._flip]
            done.record()
        if self.grammars.rows:  # their matchers take these ids before the next step samples
            sampled = np.flatnonzero(self.rows.active[:lanes] & self.rows.constrained[:lanes]).tolist()
            self.grammars.sampled(out if done is None else host, done, sampled)
        if self.spec is not None and outputs is not None and outputs.spec_counts is not None:
            self.spec.write_outputs(lanes, outputs)
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
        if self.spec is not None:
            self.spec.sampled(step.out[:step.lanes].numpy())
        step.result.device_s = step.timer.elapsed_s()
        return step.result

    @property
    def logits(self) -> torch.Tensor:
        """Last step's fp32 logits per row (rows that neither decoded nor ended a prompt: garbage)."""
        return self.state["logits"]

    def positions_host(self) -> np.ndarray:
        return self.rows.positions.copy()

    def h2d(self, arr: np.ndarray) -> torch.Tensor:
        """Every host-to-device transfer goes through here so the counters see it."""
        self._h2d_copies, self._h2d_bytes = self._h2d_copies + 1, self._h2d_bytes + arr.nbytes
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    @torch.inference_mode()
    def finish_rows(self, rows: list[int]) -> None:
        self.rows.finish(rows)
        self.grammars.finish(rows)

    def _run_step(self, chunks: list[Chunk], staging: np.ndarray, compute_slots: bool,
                  want_logprobs: bool) -> tuple[int, ChunkPlan | None, int]:
        """N of the per-row log-probabilities computed (-1: none), the chunks' plan and the lanes run."""
        rows, plan = self.rows, None
        if chunks:
            plan, ints = plan_chunks(chunks, staging, rows, want_logprobs, every_lane=self.spec is not None)
            self.prefill_state["chunk_ints"][:len(ints)].copy_(self.h2d(ints))
        facts = rows.facts()
        features = None if facts.plain else facts.features(want_logprobs)
        if facts.furthest >= self.cfg.max_seq_len:
            raise ValueError(f"a row would pass max_seq_len={self.cfg.max_seq_len}: the parent sent a step too many")
        page, lanes = self.cfg.page_size, facts.lanes
        spec = self.spec
        if spec is not None and spec.applies(plan, facts) and spec.propose(lanes, facts, features):
            return self.submit_next_level("verify", (), lanes=lanes, facts=facts, features=features), None, lanes
        if not compute_slots:
            slots = "given"
        elif rows.slot_steps > 0 and plan is None:
            slots = "advance"
            rows.slot_steps -= 1
        else:
            slots = "compute"
            # Every active row stays on its current page for this many more steps.
            live = rows.positions[rows.active]
            rows.slot_steps = int((page - 1 - live % page).min()) if live.size and plan is None else 0
        self.submit_next_level("prefill" if plan else "decode", self.prefill_args if plan else self.decode_args,
                               plan=plan, lanes=lanes, lane_lens=rows.positions[:lanes] + 1,
                               max_lane_len=facts.furthest + 1, any_random=facts.any_random,
                               any_filter=facts.any_filter, slots=slots, features=features,
                               lora=self.lora and self.lora.grouped_step(
                                   rows.token_adapters(chunks, plan.layout.lanes if plan else lanes), self.device))
        rows.advance()
        if self.spec is not None:
            self.spec.after_plain_step(lanes, plan, chunks, ints if chunks else None)
        return (-1 if features is None else features.logprobs), plan, lanes

    def _step(self, *, plan: ChunkPlan | None, lanes: int, lane_lens: np.ndarray, max_lane_len: int,
              any_random: bool, any_filter: bool, slots: str, features: Features | None, tokens=None,
              token_positions=None, token_slots=None, chunk_ints=None, prompt_lp_values=None, prompt_lp_ids=None,
              lora=None, **pooled) -> None:
        """One step over lanes [0, lanes) of the pooled tensors the task arguments name, through
        their views made once per bucket; rows above are idle and left untouched."""
        v, sampled = self.lane_views[lanes], False
        if plan is None:
            if self.graphs is not None:
                self.graphs.replay(lanes)  # its inputs are already where the command and the last step left them
            else:
                sampled = self._decode_logits(v, slots, max_lane_len, lane_lens, lora,
                                              greedy=features is None and not any_random)
        else:
            self._lane_slots(v, slots)
            torch.add(v["positions"], 1, out=v["lane_seq_lens"])
            ints = plan.layout.unpack(chunk_ints)
            hidden = self._forward_chunks(plan, v, tokens, token_positions, token_slots, ints, lora)
            n = plan.layout.lanes  # the lanes in the forward: those above only sample, where a prompt ended
            row_hidden = lane_hidden(hidden, n, lanes)
            if plan.layout.last:  # a row whose prompt ends here samples from its last token
                row_hidden.index_copy_(0, ints.last_rows, hidden.index_select(0, ints.last_index))
                v["positions"][ints.last_rows] = token_positions.index_select(0, ints.last_index)
                v["active"][ints.last_rows] = True
            # Chunk rows not ending their prompt may sit above the lanes: the full per-row state.
            self._chunk_side_effects(plan, hidden, tokens, ints.targets, pooled["output_counts"],
                                     pooled["prompt_seen"], prompt_lp_values, prompt_lp_ids)
            final_logits(self.weights, row_hidden, out=v["logits"], ops=self.ops)
        if features is not None and features.grammar:  # host work while the forward runs on an accelerator
            self.grammar_masks(v, lanes)
        self._sample(v, any_random, any_filter, features, sampled)

    def grammar_masks(self, v: dict[str, torch.Tensor], lanes: int) -> None:
        """The constrained rows' masks for this step's sample, on the device in v["grammar_mask"]."""
        rows, g = self.rows, self.grammars
        g.fill(np.flatnonzero(rows.active[:lanes] & rows.constrained[:lanes]).tolist())
        if g.mask is not self.state["grammar_mask"]:
            v["grammar_mask"].copy_(g.mask[:lanes], non_blocking=True)
            self._h2d_copies += 1
            self._h2d_bytes += lanes * g.words * 4
            if g.copied is None:
                g.copied = getattr(torch, self.device.type).Event()
            g.copied.record()

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
                       seq_lens_host: np.ndarray | None, lora: object = "masked", greedy: bool = False) -> bool:
        """A decode-only step's forward into v["logits"]. Eager steps pass the longest context and
        host lengths; a graph is captured with "compute" slots, max_seq_len and no host lengths. True:
        every lane was `greedy` and the one-call layers' head wrote the ids into v["input_ids"] too."""
        self._lane_slots(v, slots)
        torch.add(v["positions"], 1, out=v["lane_seq_lens"])
        live = live_lanes(v, self.rows.active, seq_lens_host) if self.pack_lanes else None  # idle lanes left out
        f, lens_host = (v, seq_lens_host) if live is None else (live.inputs, live.seq_lens_host)
        meta = AttentionMetadata(f["lane_starts"], f["lane_seq_lens"], f["block_table"], f["slot_mapping"], 1,
                                 max_seq_len, seq_lens_host=lens_host)
        step = self.attn.plan(meta)
        run = partial(forward, self.model_cfg, self.weights, self.attn, step, self.rope, f["input_ids"], f["positions"],
                      self.all_reduce, self.ops, self.spec and self.spec.aux(),
                      (self.lora and self.lora.step(v["lora_slot"])) if lora == "masked" else lora)
        fused = self.decode_layers  # None where LoRA, speculation or tensor parallelism runs
        head = (v["logits"], v["input_ids"], live and live.index) if greedy else None  # written after the layers read
        hidden = run() if fused is None else fused.forward(step, f["input_ids"], f["positions"], run, head)
        if hidden is None:
            return True
        out = v["logits"] if live is None else None
        logits = final_logits(self.weights, hidden, out, self.ops) if fused is None else fused.logits(hidden, out)
        if live is not None:
            v["logits"].index_copy_(0, live.index, logits)
        return False

    def _sample(self, v: dict[str, torch.Tensor], any_random: bool, any_filter: bool,
                features: Features | None, sampled: bool = False) -> None:
        """The lanes' next ids into v["input_ids"], unless `sampled` there; then active lanes' positions advance."""
        logits, input_ids, positions, active = v["logits"], v["input_ids"], v["positions"], v["active"]
        # Idle lanes' ids are never read: the parent ignores them and a chunk overwrites them.
        if features is None and not sampled:
            input_ids.copy_(sample(logits, v["temperature"], v["top_k"], v["top_p"], v["seed_keys"], positions,
                                   v["vocab_keys"], any_random, any_filter))
        elif features is not None:
            input_ids.copy_(sample_with_features(logits, RowParams.of_state(v), positions, v["vocab_keys"], any_random,
                                                 any_filter, features, v["lp_values"], v["lp_ids"]))
            if features.penalties:  # the sampled ids join their rows' outputs, on the device
                v["output_counts"].scatter_add_(1, input_ids[:, None], active[:, None].to(torch.float32))
        positions.add_(active)

    def _forward_chunks(self, plan: ChunkPlan, v: dict[str, torch.Tensor], tokens, token_positions,
                        token_slots, ints: ChunkInts, lora=None) -> torch.Tensor:
        """The forward of a step with chunks: the plan's lanes and the chunk tokens on one packed axis."""
        page = self.cfg.page_size
        n, total = plan.layout.lanes, plan.layout.lanes + plan.layout.tokens
        block_table = self.state["block_table"]  # chunk rows may sit above the lanes
        tokens[:n].copy_(v["input_ids"][:n])
        tokens[n:total].copy_(ints.ids)
        token_positions[:n].copy_(v["positions"][:n])
        token_positions[n:total].copy_(ints.positions)
        token_slots[:n].copy_(v["slot_mapping"][:n])
        torch.add(block_table[ints.rows, ints.positions // page].long() * page, ints.positions % page,
                  out=token_slots[n:total])
        seq_lens = torch.cat([v["lane_seq_lens"][:n], ints.seq_lens.to(torch.int32)])
        max_len = max(plan.seq_lens)
        width = -(-max_len // page)
        meta = AttentionMetadata(ints.query_starts.to(torch.int32), seq_lens,
                                 block_table.index_select(0, ints.seq_rows)[:, :width], token_slots[:total],
                                 max(plan.max_query_len, 1), max_len, query_lens_host=plan.query_lens,
                                 seq_lens_host=plan.seq_lens)
        return forward(self.model_cfg, self.weights, self.attn, self.attn.plan(meta), self.rope, tokens[:total],
                       token_positions[:total], self.all_reduce, self.ops, self.spec and self.spec.aux(), lora)

    def _chunk_side_effects(self, plan: ChunkPlan, hidden, tokens, targets, output_counts, prompt_seen,
                            prompt_lp_values, prompt_lp_ids) -> None:
        """Penalty state from the chunks' ids (prompt part: seen; past prompt_len: output counts),
        and prompt log-probabilities for the chunks that asked."""
        lanes = plan.layout.lanes  # the forward's lanes, before the chunks on the packed axis
        for row, first, in_prompt, in_output in plan.penalized:
            ids = tokens[lanes + first:lanes + first + in_prompt + in_output]
            if in_prompt:
                prompt_seen[row, ids[:in_prompt]] = 1.0
            if in_output:
                output_counts[row].index_add_(0, ids[in_prompt:], torch.ones(in_output, dtype=output_counts.dtype,
                                                                              device=ids.device))
        taken = 0
        for first, count, _, top in plan.prompt_asks:
            prompt_logprobs(self.weights, self.ops, hidden[lanes + first:lanes + first + count],
                            targets[taken:taken + count], first, top, prompt_lp_values, prompt_lp_ids)
            taken += count

    @torch.inference_mode()
    def time_steps(self, prefill_tokens: int, steps: int, budget_s: float) -> tuple[float, float]:
        """Wall times of a prefill step and of a decode step: see chip_child.step.warmup.time_steps."""
        return time_steps(self, prefill_tokens, steps, budget_s)

    @torch.inference_mode()
    def reset(self) -> None:
        """With no row active: every row's tables and the KV cache zeroed, as warm-up leaves them."""
        self.rows.reset()
        self.pool.zero(self.state["kv_cache"])
        self.attn.invalidate()

    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        """One graph per lane bucket, the largest first (the smaller ones reuse its memory). Every
        row is idle here, so the runs made while capturing write only to the scratch page."""
        for lanes in sorted(self.lane_views, reverse=True):
            graphs.capture(lanes, partial(self._decode_logits, self.lane_views[lanes], "compute", self.cfg.max_seq_len,
                                          None))
        self.graphs, self._pending_graphs = graphs, None
