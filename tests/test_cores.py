"""Core pinning of cpu children: each child's threads on cores of its own, every ZeroMQ socket
thread on the rest, where the children's threads leave a core over (by default they take every
core, and nothing is pinned). A module of its own: a worker left alive by another test holds the cores and
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
def test_default_threads_take_every_core_unpinned_with_a_short_openmp_spin(ckpt: Path) -> None:
    with DistributedWorker(ckpt, **{**COMMON, "num_threads": None}) as w:
        pid = w.child_pids[0]
        assert w.stats()["child_threads"] == len(allowed_cores())
        assert os.sched_getaffinity(pid) == set(allowed_cores())
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        if not any(name in os.environ for name in device.OMP_WAIT_VARIABLES):
            assert env["GOMP_SPINCOUNT"] == str(device.CHILD_GOMP_SPINCOUNT)
        if len(allowed_cores()) > 1:
            assert w._doorbell.spin_s == 0.0  # no core is free for a spinning parent


def test_the_users_openmp_wait_settings_win() -> None:
    assert device.child_environment({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
    assert device.child_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
    assert device.child_environment({}) == {"GOMP_SPINCOUNT": str(device.CHILD_GOMP_SPINCOUNT)}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_a_second_worker_is_left_unpinned_while_the_first_holds_its_cores(ckpt: Path) -> None:
    plan = plan_cores(1, 1)
    if plan is None:
        pytest.skip("needs a core beyond the child's")
    with DistributedWorker(ckpt, **COMMON) as first:
        assert os.sched_getaffinity(first.child_pids[0]) == set(plan.children[0])
        with DistributedWorker(ckpt, **COMMON) as second:  # the same plan would stack both children
            assert os.sched_getaffinity(second.child_pids[0]) == set(allowed_cores())
    with DistributedWorker(ckpt, **COMMON) as third:  # the first closed: its cores are free again
        assert os.sched_getaffinity(third.child_pids[0]) == set(plan.children[0])


def test_accelerator_children_are_not_pinned(ckpt: Path) -> None:
    assert DistributedWorker(ckpt, **{**COMMON, "device": "cuda"})._plan_cores(1) is None


def test_pin_cores_must_be_a_bool(ckpt: Path) -> None:
    with pytest.raises(TypeError, match="pin_cores"):
        DistributedWorker(ckpt, **COMMON, pin_cores="yes")


def test_core_plan_leaves_a_core_over_or_pins_nothing(monkeypatch) -> None:
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(8)))
    assert plan_cores(2, 3) == CorePlan(service=[0, 1], children=[[2, 3, 4], [5, 6, 7]])
    assert plan_cores(1, 4) == CorePlan(service=[0, 1, 2, 3], children=[[4, 5, 6, 7]])
    assert plan_cores(2, 4) is None  # the children would take every core
    assert plan_cores(2, None) is None  # and by default they do: 4 threads each
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(7)))
    assert plan_cores(2, None) == CorePlan(service=[0], children=[[1, 2, 3], [4, 5, 6]])  # one left over
    monkeypatch.setattr(device, "allowed_cores", lambda: [0])
    assert plan_cores(1, None) is None
