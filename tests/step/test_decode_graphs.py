"""Decode lanes narrowed to a bucket, and decode graphs, on the cpu.

The cuda capture itself is tested on a GPU in tests/gpu/test_cuda.py; the npu capture has not run on
hardware. What is checked here: the property a captured step relies on (a forward made with the bucket's bound host
values gives the exact forward's logits while lengths, positions, slots and block tables change),
the capture/replay driving with a stand-in capturer that replays the captured callable with its
capture-time host arguments, and the options' validation."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.step.graphs import bucket_of, lane_buckets, resolve_decode_graphs
from chip_child.step.runtime import ChipRuntime
from chip_child.step.task_args import LANE_SLOTS
from l3worker import DistributedWorker, SamplingParams
from l3worker.engine.scheduler import Scheduler, Sequence

from graph_helpers import StandInCapturer

BATCH = 8
PAGE = 4


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


def make_runtime(path: Path, capturer: StandInCapturer | None = None, **kw) -> ChipRuntime:
    # the torch backend: the capturable one on the cpu (the cpu backend's decode kernel reads host pointers)
    cfg = dict(device="cpu", dtype="float32", max_batch_size=BATCH, max_seq_len=96, page_size=PAGE,
               max_prefill_tokens=24, attention_backend="torch") | kw
    return ChipRuntime(RuntimeConfig(str(path), **cfg), graph_capturer=capturer)


WORKLOAD = [  # more requests than rows, taken lowest index first; the low rows run longest, so the
    # decode lanes narrow 8 -> 4 -> 2 -> 1 as the high rows finish
    ([3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_new_tokens=40)),
    (list(range(10, 31)), SamplingParams(max_new_tokens=30, temperature=0.9, top_k=20, seed=1)),
    ([7] * 9, SamplingParams(max_new_tokens=24, temperature=1.1, top_p=0.8, seed=2)),
    ([2, 7], SamplingParams(temperature=0.0, max_new_tokens=4)),
    (list(range(40, 53)), SamplingParams(temperature=0.0, max_new_tokens=18, presence_penalty=0.5, repetition_penalty=1.3)),
    ([9, 9, 8], SamplingParams(max_new_tokens=3, temperature=0.7, min_p=0.2, seed=3)),
    (list(range(100, 131)), SamplingParams(temperature=0.0, max_new_tokens=9)),
    ([5], SamplingParams(max_new_tokens=12, temperature=1.0, seed=4)),
    ([6, 6], SamplingParams(temperature=0.0, max_new_tokens=5)),
    (list(range(200, 217)), SamplingParams(max_new_tokens=10, temperature=0.8, top_k=5, seed=5)),
    ([11, 12, 13], SamplingParams(temperature=0.0, max_new_tokens=8)),
]


def run_scheduled(rt: ChipRuntime, workload=WORKLOAD, budget: int = 24,
                  on_step: Callable[[dict], None] | None = None) -> list[list[int]]:
    """Drives the runtime in-process with the worker's scheduler (one command in flight): rows
    admitted as others finish, prompts chunked beside decoding rows, pages taken at boundaries."""
    cfg = rt.cfg
    sched = Scheduler(max_batch_size=cfg.max_batch_size, page_size=cfg.page_size,
                      max_blocks_per_row=cfg.max_blocks_per_row, num_pages=cfg.total_pages - 1,
                      max_num_batched_tokens=budget, enable_prefix_caching=True,
                      full_state=cfg.copy_policy == "always")
    seqs = [Sequence(i, 0, np.asarray(p, np.int32), params, params.seed or 0, frozenset())
            for i, (p, params) in enumerate(workload)]
    sched.add(seqs)
    out = torch.zeros(cfg.max_batch_size, dtype=torch.int32)
    staging = np.zeros(cfg.prefill_capacity + 1, np.int32)
    if on_step is not None:
        submit = rt.submit_next_level

        def observed(name, args, **scalars):
            on_step(dict(scalars, name=name, before=True))
            result = submit(name, args, **scalars)
            on_step(dict(scalars, name=name, before=False))
            return result

        rt.submit_next_level = observed
    while (s := sched.next_command()) is not None:
        for offset, ids in s.staging_tokens:
            staging[offset:offset + len(ids)] = ids
        rt.execute(s.command, staging, out)
        sched.on_tokens(s.producers, out.numpy(), time.perf_counter())
    assert all(len(seq.tokens) == params.max_new_tokens for seq, (_, params) in zip(seqs, workload))
    return [seq.tokens for seq in seqs]


@pytest.fixture(scope="module")
def eager_tokens(ckpt) -> list[list[int]]:
    return run_scheduled(make_runtime(ckpt))


# -- lane buckets ----------------------------------------------------------------------------------

def test_lane_buckets_are_powers_of_two_and_the_batch() -> None:
    assert lane_buckets(16) == (1, 2, 4, 8, 16)
    assert lane_buckets(12) == (1, 2, 4, 8, 12)
    assert lane_buckets(1) == (1,)
    assert bucket_of(12).tolist() == [1, 1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]


def test_steps_run_only_their_bucket_and_leave_the_lanes_above_untouched(ckpt, eager_tokens) -> None:
    """Every step runs the bucket of its highest active row; rows above it keep every per-row
    tensor bit for bit (but the penalty counts of a prompt chunked there), and the tokens are
    those of a run whose lanes cover other rows."""
    rt = make_runtime(ckpt)
    seen: dict[str, set[int]] = {"decode": set(), "prefill": set()}
    snap: dict[str, torch.Tensor] = {}
    chunked_above = []

    def on_step(s: dict) -> None:
        lanes = s["lanes"]
        active = np.flatnonzero(rt.rows.active)
        if s["before"]:
            assert lanes == bucket_of(BATCH)[active[-1] + 1 if active.size else 0]
            seen[s["name"]].add(lanes)
            snap.update({slot: rt.state[slot][lanes:].clone() for slot in LANE_SLOTS})
            return
        # A penalized prompt chunked in a row above the lanes counts its ids there.
        counted = {row for row, *_ in s["plan"].penalized} if s["plan"] else set()
        chunked_above.extend(row for row in counted if row >= lanes)
        for slot in LANE_SLOTS:
            now, then = rt.state[slot][lanes:], snap[slot]
            if slot in ("prompt_seen", "output_counts"):
                keep = [r - lanes for r in range(lanes, BATCH) if r not in counted]
                now, then = now[keep], then[keep]
            assert torch.equal(now, then), f"{slot} changed above lane {lanes}"

    assert run_scheduled(rt, on_step=on_step) == eager_tokens
    assert seen["decode"] == {1, 2, 4, 8} and len(seen["prefill"]) >= 2  # buckets grow and shrink
    assert chunked_above  # the workload does chunk a penalized prompt above the lanes
    wide = run_scheduled(make_runtime(ckpt, max_batch_size=16, max_seq_len=96))  # other buckets, same rows
    assert wide == eager_tokens


# -- what a graph relies on ------------------------------------------------------------------------

def test_decode_forward_with_bucket_bounds_equals_the_exact_one(ckpt) -> None:
    """At every decode step the forward made as a graph is captured (lanes = the bucket,
    max_seq_len = the config's, so the block table is read at full width, slots computed on the
    device, no host lengths) gives the logits and slots of the exact eager forward, while
    lengths, positions, slot mappings and block tables change from step to step."""
    rt = make_runtime(ckpt)
    exact = rt._decode_logits
    checked = []

    def both(v, slots, max_seq_len, seq_lens_host, lora=None, greedy=False):
        before = v["slot_mapping"].clone()
        exact(v, "compute", rt.cfg.max_seq_len, None)
        bound_logits, bound_slots = v["logits"].clone(), v["slot_mapping"].clone()
        v["slot_mapping"].copy_(before)  # the eager step may advance the slots from where they were
        exact(v, slots, max_seq_len, seq_lens_host, lora)
        active = v["active"]
        assert max_seq_len < rt.cfg.max_seq_len  # the bound differs from the exact value
        torch.testing.assert_close(bound_logits[active], v["logits"][active], rtol=0, atol=1e-5)
        assert torch.equal(bound_slots[active], v["slot_mapping"][active])
        assert not bound_slots[~active].any()  # idle lanes write to the scratch page
        checked.append((len(active), int(active.sum()), max_seq_len, slots))
        return False  # the ids are the sampler's (float32: no one-call head)

    rt._decode_logits = both
    run_scheduled(rt)
    assert len(checked) > 25
    assert {c[0] for c in checked} == {1, 2, 4, 8} and {c[3] for c in checked} == {"compute", "advance"}
    assert any(lanes > busy for lanes, busy, _, _ in checked)  # idle lanes inside the bucket too


# -- capture and replay, with a stand-in -----------------------------------------------------------

def test_replayed_graphs_give_the_eager_tokens(ckpt, eager_tokens) -> None:
    capturer = StandInCapturer()
    rt = make_runtime(ckpt, capturer)
    assert rt.graphs is not None and rt.graphs.lanes == lane_buckets(BATCH)
    assert capturer.captured == len(lane_buckets(BATCH)) and capturer.replays == 0
    assert not rt.attn.decode_mirror  # its host bookkeeping would be frozen in a graph
    assert run_scheduled(rt) == eager_tokens
    assert capturer.replays > 25


def test_replayed_graphs_give_the_eager_tokens_with_copy_policy_always(ckpt) -> None:
    capturer = StandInCapturer()
    eager = run_scheduled(make_runtime(ckpt, copy_policy="always"))
    assert run_scheduled(make_runtime(ckpt, capturer, copy_policy="always")) == eager
    assert capturer.replays > 25


def test_a_graph_that_froze_a_host_length_is_caught(ckpt, eager_tokens, monkeypatch) -> None:
    """The stand-in is sensitive: a capture that freezes the capture-time context (one block of
    the block table) instead of the bound gives other tokens."""
    original = ChipRuntime._decode_logits

    def frozen(self, v, slots, max_seq_len, seq_lens_host, lora="masked", greedy=False):
        return original(self, v, slots, PAGE if seq_lens_host is None else max_seq_len, seq_lens_host, lora, greedy)

    monkeypatch.setattr(ChipRuntime, "_decode_logits", frozen)
    assert run_scheduled(make_runtime(ckpt, StandInCapturer())) != eager_tokens


# -- options ---------------------------------------------------------------------------------------

def test_decode_graphs_option_resolution() -> None:
    assert resolve_decode_graphs(None, "cuda", True, "triton") is True
    assert resolve_decode_graphs(None, "npu", True, "torch") is True
    assert resolve_decode_graphs(None, "cpu", True, "torch") is False
    assert resolve_decode_graphs(None, "npu", False, "npu") is False  # the vendor op takes host lengths
    assert resolve_decode_graphs(False, "cuda", True, "triton") is False
    assert resolve_decode_graphs(None, "cuda", True, "triton", model_capturable=False) is False  # MoE
    with pytest.raises(ValueError, match="decode_graphs=True.*MoE"):
        resolve_decode_graphs(True, "cuda", True, "triton", model_capturable=False)
    with pytest.raises(ValueError, match="decode_graphs=True needs a cuda or npu device, got cpu"):
        resolve_decode_graphs(True, "cpu", True, "torch")
    with pytest.raises(ValueError, match="attention_backend='npu'"):
        resolve_decode_graphs(True, "npu", False, "npu")
    with pytest.raises(TypeError, match="decode_graphs must be a bool or None"):
        resolve_decode_graphs("yes", "cuda", True, "triton")


def test_decode_graphs_true_on_cpu_is_refused(ckpt) -> None:
    with pytest.raises(ValueError, match="decode_graphs=True needs a cuda or npu device"):
        make_runtime(ckpt, decode_graphs=True)
    assert make_runtime(ckpt, decode_graphs=False).graphs is None
    assert make_runtime(ckpt).graphs is None  # None: off on the cpu


@pytest.fixture
def no_children(monkeypatch):
    """Fails the test if a worker tries to start a child."""
    def refuse(*args, **kwargs):
        raise AssertionError("a child was started")

    monkeypatch.setattr("l3worker.worker.distributed_worker.ChildProcess", refuse)


@pytest.mark.parametrize("kw,match", [
    (dict(attention_backend="flash"), r"attention_backend must be one of \('torch', 'cpu', 'triton', 'npu'\)"),
    (dict(attention_backend="npu"), r"attention_backend='npu' cannot run on cpu; choices for cpu: \('torch',"),
    (dict(decode_graphs=True), "decode_graphs=True needs a cuda or npu device, got cpu"),
], ids=["unknown-backend", "npu-on-cpu", "graphs-on-cpu"])
def test_worker_refuses_bad_options_before_any_child_starts(ckpt, no_children, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedWorker(ckpt, device="cpu", **kw)


def test_worker_refuses_triton_on_cpu_without_the_interpreter(ckpt, no_children, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run on cpu \(only under "
                                         r"TRITON_INTERPRET=1\); choices for cpu: \('torch', 'cpu'\)"):
        DistributedWorker(ckpt, device="cpu", attention_backend="triton")


def test_worker_runs_with_the_torch_backend_named(ckpt) -> None:
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    with DistributedWorker(ckpt, device="cpu", max_batch_size=4, max_seq_len=64, page_size=PAGE,
                           max_num_batched_tokens=24, attention_backend="torch", pin_cores=False) as w:
        named = [o.token_ids for o in w.generate(prompts, params)]
        stats = w.stats()
    assert stats["attention_backend"] == "torch" and stats["decode_graphs"] == []
    assert w.runtime_config.attention_backend == "torch"
    rt = make_runtime(ckpt, max_batch_size=4, max_seq_len=64)
    assert named == run_scheduled(rt, [(p, params) for p in prompts])
