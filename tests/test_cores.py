"""Core pinning of cpu children: each child's threads on cores of its own, every ZeroMQ socket
thread on the rest. A module of its own: a worker left alive by another test holds the cores and
leaves later workers unpinned, as it should."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from chip_child import device
from chip_child.device import CorePlan, allowed_cores, plan_cores
from l3worker import DistributedWorker, SamplingParams

COMMON = dict(max_batch_size=2, max_seq_len=64, page_size=8, device="cpu", num_threads=1, step_timeout_s=60.0)
PROMPT = np.random.default_rng(7).integers(0, 300, 6).tolist()


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


def zmq_threads(pid: int) -> list[int]:
    """The ids of a process's ZeroMQ background threads (named ZMQbg/... by libzmq)."""
    task = f"/proc/{pid}/task"
    return [int(t) for t in os.listdir(task) if open(f"{task}/{t}/comm").read().startswith("ZMQbg")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_cpu_child_computes_on_its_own_cores_and_socket_threads_on_the_rest(ckpt: Path) -> None:
    plan = plan_cores(1, 1)
    if plan is None:
        pytest.skip("needs a core beyond the child's")
    parent_before = set(zmq_threads(os.getpid()))
    with DistributedWorker(ckpt, **COMMON) as w:
        pid = w.child_pids[0]
        assert os.sched_getaffinity(pid) == set(plan.children[0])
        child_io = zmq_threads(pid)
        parent_io = set(zmq_threads(os.getpid())) - parent_before
        assert child_io and parent_io
        for tid in [*child_io, *parent_io]:
            assert os.sched_getaffinity(tid) == set(plan.service)
        pinned_tokens = w.generate(PROMPT, SamplingParams(max_new_tokens=8))[0].token_ids
    with DistributedWorker(ckpt, **COMMON, pin_cores=False) as w:
        assert os.sched_getaffinity(w.child_pids[0]) == set(allowed_cores())
        assert all(os.sched_getaffinity(t) == set(allowed_cores()) for t in zmq_threads(w.child_pids[0]))
        assert w.generate(PROMPT, SamplingParams(max_new_tokens=8))[0].token_ids == pinned_tokens


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_default_threads_fill_the_pinned_cores_and_a_second_worker_is_left_unpinned(ckpt: Path) -> None:
    plan = plan_cores(1, None)
    if plan is None:
        pytest.skip("needs a core beyond the child's")
    with DistributedWorker(ckpt, **{**COMMON, "num_threads": None}) as first:
        assert os.sched_getaffinity(first.child_pids[0]) == set(plan.children[0])
        assert first.stats()["child_threads"] == len(plan.children[0])
        with DistributedWorker(ckpt, **COMMON) as second:  # the same plan would stack both children
            assert os.sched_getaffinity(second.child_pids[0]) == set(allowed_cores())
    with DistributedWorker(ckpt, **COMMON) as third:  # the first closed: its cores are free again
        assert os.sched_getaffinity(third.child_pids[0]) == set(plan_cores(1, 1).children[0])


def test_accelerator_children_are_not_pinned(ckpt: Path) -> None:
    assert DistributedWorker(ckpt, **{**COMMON, "device": "cuda"})._plan_cores(1) is None


def test_pin_cores_must_be_a_bool(ckpt: Path) -> None:
    with pytest.raises(TypeError, match="pin_cores"):
        DistributedWorker(ckpt, **COMMON, pin_cores="yes")


def test_core_plan_leaves_a_core_over_or_pins_nothing(monkeypatch) -> None:
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(8)))
    assert plan_cores(2, None) == CorePlan(service=[0, 1], children=[[2, 3, 4], [5, 6, 7]])  # 3 threads each
    assert plan_cores(1, 4) == CorePlan(service=[0, 1, 2, 3], children=[[4, 5, 6, 7]])
    assert plan_cores(2, 4) is None  # the children would take every core
    monkeypatch.setattr(device, "allowed_cores", lambda: [0])
    assert plan_cores(1, None) is None
