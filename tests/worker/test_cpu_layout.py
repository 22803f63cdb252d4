"""cpu_layout="auto": the timing-free rule, the trial's margin against its own noise, and that the
layout chosen is the one the threads then run with and the one reported. Timings are faked
throughout: what is tested is the decision, never the machine's speed."""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import asdict

import pytest
import torch

from chip_child import cpu_layout
from chip_child.config import RuntimeConfig
from chip_child.cpu_layout import (EVERY_CORE_MIN_WEIGHTS, SWITCH_MARGIN, LayoutCores, choose_cpu_layout,
                                   decide_cpu_layout, preferred_cpu_layout, set_layout, step_weight_elements)
from chip_child.device import allowed_cores, process_threads
from chip_child.models.loader import load_config
from chip_child.step.runtime import ChipRuntime
from chip_child.child_spec import ChildSpec
from fault_helpers import wait_for

needs_affinity = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(allowed_cores()) < 2,
                                    reason="sets thread affinities through /proc on two cores or more")


def test_step_weights_count_what_a_decode_step_reads(make_checkpoint) -> None:
    cfg = load_config(make_checkpoint("default"))
    hd, h = cfg.head_dim, cfg.hidden_size
    layer = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    assert step_weight_elements(cfg) == cfg.num_layers * layer + h * cfg.vocab_size


def test_step_weights_of_a_sparse_layer_count_its_router_and_top_k_experts(make_checkpoint) -> None:
    cfg = load_config(make_checkpoint("layout-moe", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, mlp_only_layers=[1]))
    moe = cfg.moe
    assert moe is not None and moe.top_k < moe.num_experts and moe.sparse_layers == (0,)
    hd, h = cfg.head_dim, cfg.hidden_size
    attention = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer = [attention + (moe.num_experts * h + moe.top_k * 3 * h * moe.intermediate_size
                              if i in moe.sparse_layers else 3 * h * cfg.intermediate_size)
                 for i in range(cfg.num_layers)]
    assert step_weight_elements(cfg) == sum(per_layer) + h * cfg.vocab_size


@pytest.mark.parametrize("weights, cores, preferred", [
    (EVERY_CORE_MIN_WEIGHTS, 2, "every_core"),
    (EVERY_CORE_MIN_WEIGHTS - 1, 2, "spare_core"),  # ops too small to split
    (10 * EVERY_CORE_MIN_WEIGHTS, cpu_layout.EVERY_CORE_MAX_CORES, "every_core"),
    (10 * EVERY_CORE_MIN_WEIGHTS, cpu_layout.EVERY_CORE_MAX_CORES + 1, "spare_core"),  # one core is a small share
    (10 * EVERY_CORE_MIN_WEIGHTS, 1, "spare_core"),
])
def test_preferred_layout_needs_no_timing(weights: int, cores: int, preferred: str) -> None:
    assert preferred_cpu_layout(weights, cores) == preferred


def noisy(rng: random.Random, mean: float, spread: float, rounds: int = 3) -> list[float]:
    return [mean * (1 + rng.uniform(-spread, spread)) for _ in range(rounds)]


@pytest.mark.parametrize("preferred, spare_s, every_s, spread, chosen", [
    # a quiet machine, a model of a few million weights: every core ~20% faster, noise +-8%
    ("every_core", 3.6, 2.8, 0.08, "every_core"),
    # a tiny model: neither layout faster, noise +-10% either way
    ("spare_core", 1.0, 1.0, 0.10, "spare_core"),
    ("every_core", 1.0, 1.0, 0.10, "every_core"),
    # every core 5% faster, within what the noise can make of it: the rule's choice stands
    ("spare_core", 1.0, 0.95, 0.05, "spare_core"),
    # another process keeps a core busy throughout: every core's team waits, several times slower
    ("every_core", 3.6, 11.5, 0.05, "spare_core"),
    # the other layout faster in every round by far more than the margin and the spread
    ("spare_core", 10.0, 3.0, 0.10, "every_core"),
])
def test_the_same_choice_whatever_the_noise(preferred, spare_s, every_s, spread, chosen) -> None:
    for seed in range(200):  # 200 starts of one model, each trial timed with fresh noise
        rng = random.Random(seed)
        times = {"spare_core": noisy(rng, spare_s, spread), "every_core": noisy(rng, every_s, spread)}
        assert decide_cpu_layout(times, preferred) == chosen, (seed, times)


def test_one_round_disturbed_moves_nothing() -> None:
    """A burst of load elsewhere during one every_core round (the cause of the flips seen before)."""
    assert decide_cpu_layout({"spare_core": [3.6, 3.7, 3.5], "every_core": [2.8, 11.5, 2.9]}, "every_core") == \
        "every_core"
    # the other layout's slowest round must beat the preferred one's fastest by the margin ...
    edge = 1 / (1 + SWITCH_MARGIN)
    assert decide_cpu_layout({"spare_core": [1.0] * 3, "every_core": [edge] * 3}, "spare_core") == "spare_core"
    assert decide_cpu_layout({"spare_core": [1.0] * 3, "every_core": [0.99 * edge] * 3}, "spare_core") == "every_core"
    # ... plus the largest spread of one layout's rounds (here 20%)
    edge = 1 / (1 + SWITCH_MARGIN + 0.2)
    assert decide_cpu_layout({"spare_core": [1.0, 1.0, 1.2], "every_core": [edge] * 3}, "spare_core") == "spare_core"
    assert decide_cpu_layout({"spare_core": [1.0, 1.0, 1.2], "every_core": [0.99 * edge] * 3},
                             "spare_core") == "every_core"


def test_other_processes_busy_through_the_trial_mean_spare_core() -> None:
    quiet_times = {"spare_core": [3.6, 3.7, 3.5], "every_core": [2.8, 2.9, 2.8]}
    assert decide_cpu_layout(quiet_times, "every_core", other_cores=cpu_layout.LOADED_CORES) == "every_core"
    assert decide_cpu_layout(quiet_times, "every_core", other_cores=1.2) == "spare_core"
    assert decide_cpu_layout({"spare_core": [1.0] * 3, "every_core": [0.3] * 3}, "spare_core", 1.2) == "spare_core"


class FakeSteps:
    """time_steps() under whichever layout the threads are set to: every_core is a thread per
    core with this thread on every core; noisy times, a fresh seed per start."""

    def __init__(self, cores: list[int], spare_s: float, every_s: float, seed: int):
        self.cores, self.me = cores, threading.get_native_id()
        self.times = {"spare_core": spare_s, "every_core": every_s}
        self.rng = random.Random(seed)
        self.seen: list[str] = []

    def __call__(self, *args) -> tuple[float, float]:
        every = torch.get_num_threads() == len(self.cores) and os.sched_getaffinity(self.me) == set(self.cores)
        layout = "every_core" if every else "spare_core"
        self.seen.append(layout)
        s = self.times[layout] * (1 + self.rng.uniform(-0.08, 0.08))
        return 10 * s, s


class FakeLoad:
    """_others_busy_s: `cores` busy elsewhere per second of the (real) clock."""

    def __init__(self, cores: float):
        self.cores = cores

    def __call__(self) -> float:
        return self.cores * time.perf_counter()


@pytest.fixture
def restore_threads():
    cores, threads = allowed_cores(), torch.get_num_threads()
    yield cores
    for tid in process_threads():  # set_layout moves every thread of the process
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass
    torch.set_num_threads(threads)


@needs_affinity
@pytest.mark.parametrize("preferred, every_s, chosen", [
    ("every_core", 0.5, "every_core"), ("every_core", 3.0, "spare_core"),
    ("spare_core", 0.95, "spare_core"), ("spare_core", 0.3, "every_core"),
])
def test_the_threads_run_as_chosen(restore_threads, monkeypatch, preferred, every_s, chosen) -> None:
    cores = restore_threads
    monkeypatch.setattr(cpu_layout, "_others_busy_s", FakeLoad(0.0))
    layouts = LayoutCores(every=cores, spare=cores[-1:], service=cores[:1])
    set_layout(preferred, layouts)  # the child starts as the rule prefers
    steps = FakeSteps(cores, 1.0, every_s, seed=0)
    result = choose_cpu_layout(steps, layouts, preferred)
    assert result["layout"] == chosen and result["preferred"] == preferred and result["trial_s"] >= 0
    assert result["other_cores"] == pytest.approx(0.0)
    assert set(result["step_s"]) == {"spare_core", "every_core"}
    assert steps.seen == ["spare_core", "every_core"] * cpu_layout.ROUNDS  # alternated
    if chosen == "every_core":
        assert torch.get_num_threads() == len(cores) and os.sched_getaffinity(0) == set(cores)
    else:
        assert torch.get_num_threads() == len(cores) - 1 and os.sched_getaffinity(0) == {cores[-1]}


@needs_affinity
def test_a_trial_on_a_loaded_machine_keeps_a_core_spare(restore_threads, monkeypatch) -> None:
    cores = restore_threads
    monkeypatch.setattr(cpu_layout, "_others_busy_s", FakeLoad(1.0))
    layouts = LayoutCores(every=cores, spare=cores[-1:], service=cores[:1])
    set_layout("every_core", layouts)
    result = choose_cpu_layout(FakeSteps(cores, 1.0, 0.5, seed=0), layouts, "every_core")
    assert result["layout"] == "spare_core" and result["other_cores"] == pytest.approx(1.0, rel=0.05)
    assert torch.get_num_threads() == len(cores) - 1 and os.sched_getaffinity(0) == {cores[-1]}


@needs_affinity
@pytest.mark.parametrize("preferred, every_s, chosen", [
    ("spare_core", 0.95, "spare_core"),  # every core barely faster: the preference holds
    ("every_core", 1.05, "every_core"),  # spare_core barely faster: likewise
    ("every_core", 3.0, "spare_core"),  # every core far slower: the trial moves it
])
def test_back_to_back_starts_choose_the_same_layout_and_report_it(make_checkpoint, monkeypatch, restore_threads,
                                                                  preferred, every_s, chosen) -> None:
    """The child's start-up (chip_child.serve.start_runtime), twice, each with its own noise,
    from threads set up as the parent sets up the preferred layout."""
    from chip_child.serve import ready_message, start_runtime
    import msgpack

    cores = restore_threads
    monkeypatch.setattr(cpu_layout, "_others_busy_s", FakeLoad(0.0))
    layouts = LayoutCores(every=cores, spare=cores[1:], service=cores[:1])
    rc = RuntimeConfig(str(make_checkpoint("default")), device="cpu", dtype="float32", max_batch_size=2,
                       max_seq_len=64, page_size=8, num_threads=layouts.threads(preferred))
    spec = ChildSpec(rank=0, socket_dir="", runtime=asdict(rc), buffers={},
                     cpu_cores=layouts.spare if preferred == "spare_core" else None,
                     layout_trial={"preferred": preferred, **asdict(layouts)}, step_core=cores[0])
    for seed in range(2):
        monkeypatch.setattr(ChipRuntime, "time_steps", FakeSteps(cores, 1.0, every_s, seed))
        rt, layout = start_runtime(spec)
        try:
            ready = msgpack.unpackb(ready_message(rt, layout))
        finally:
            rt.close()
        assert ready["cpu_layout"] == chosen and ready["layout_preferred"] == preferred
        assert ready["threads"] == layouts.threads(chosen) == torch.get_num_threads()
        assert ready["cores"] == sorted(layouts.mask(chosen))
        # every_core: the step thread (this one) alone on the step core, the rest elsewhere
        step = cores[0] if chosen == "every_core" else None
        assert ready["step_core"] == step
        assert os.sched_getaffinity(0) == ({step} if step is not None else set(layouts.mask(chosen)))
        others = [tid for tid in process_threads() if tid != threading.get_native_id()]
        if step is not None:
            assert all(os.sched_getaffinity(t) == set(cores[1:]) for t in others)
        for tid in process_threads():  # as the next start's process would begin
            os.sched_setaffinity(tid, cores)


@needs_affinity
def test_socket_threads_go_where_the_chosen_layout_puts_them(restore_threads) -> None:
    """A worker with the layout fixed pins its ZeroMQ threads to the service core under
    spare_core and leaves them on every core under every_core; set_layout does the same to
    threads that already run."""
    import zmq

    cores = restore_threads
    layouts = LayoutCores(every=cores, spare=cores[1:], service=cores[:1])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)  # starts the context's threads, which name themselves soon after

    def socket_threads() -> list[int]:
        return [tid for tid, name in process_threads().items() if name.startswith("ZMQbg/")]

    try:
        assert wait_for(lambda: socket_threads())
        sockets = socket_threads()
        set_layout("spare_core", layouts)
        assert all(os.sched_getaffinity(t) == {cores[0]} for t in sockets)
        assert os.sched_getaffinity(0) == set(cores[1:])
        set_layout("every_core", layouts)
        assert all(os.sched_getaffinity(t) == set(cores) for t in sockets)
        assert os.sched_getaffinity(0) == set(cores)
    finally:
        sock.close()
        ctx.term()
