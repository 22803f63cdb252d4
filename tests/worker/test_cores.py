"""Core layouts of cpu children: each child's threads on cores of its own and every ZeroMQ socket
thread on the rest where the children's threads leave a core over; every core to the child
where the start-up trial (cpu_layout="auto") or the user says so. A module of its own: a worker
left alive by another test holds the cores and leaves later workers unpinned, as it should."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from chip_child import cpu_layout, device, environment
from l3worker.worker import cpu_placement
from l3worker.worker.cpu_placement import CpuPlacement
from chip_child.device import CorePlan, allowed_cores, plan_cores
from l3worker import DistributedWorker, SamplingParams

COMMON = dict(max_batch_size=2, max_seq_len=64, page_size=8, device="cpu", num_threads=1, step_timeout_s=60.0)
PROMPT = np.random.default_rng(7).integers(0, 300, 6).tolist()


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


@pytest.fixture
def sole_worker() -> None:
    """A worker of another test module that this process keeps alive (a module-scoped fixture,
    under pytest-xdist) holds its cores, and the workers made here then pin nothing, as they
    should: the tests that check the pins skip."""
    from l3worker.worker.teardown import live_workers

    if any(w._core_plan or w.step_core is not None or w._placement._claim is not None for w in live_workers):
        pytest.skip("another live worker of this process holds its cores")


def zmq_threads(pid: int) -> list[int]:
    """The ids of a process's ZeroMQ background threads (named ZMQbg/... by libzmq)."""
    task = f"/proc/{pid}/task"
    return [int(t) for t in os.listdir(task) if open(f"{task}/{t}/comm").read().startswith("ZMQbg")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
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
        pinned_tokens = w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids
    with DistributedWorker(ckpt, **COMMON, pin_cores=False) as w:
        assert os.sched_getaffinity(w.child_pids[0]) == set(allowed_cores())
        assert all(os.sched_getaffinity(t) == set(allowed_cores()) for t in zmq_threads(w.child_pids[0]))
        assert w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids == pinned_tokens


def child_env(pid: int) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)


def assert_every_core(w: DistributedWorker, cores: list[int] | None = None) -> None:
    """A thread per core of `cores` (default: this thread's); the step thread (the child's main
    thread) alone on the first core, every other thread of the child on the rest."""
    pid, cores = w.child_pids[0], cores or allowed_cores()
    s = w.stats()
    assert s["child_threads"] == len(cores) and s["child_cores"] == cores
    assert w.step_core == s["cpu_step_core"] == cores[0]
    assert os.sched_getaffinity(pid) == {cores[0]}
    others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert len(others) >= len(cores)  # OpenMP workers, the step team, socket threads
    assert all(os.sched_getaffinity(t) == set(cores[1:]) for t in others)
    assert w._doorbell.spin_s == 0.0  # no core is free for a spinning parent


def assert_spare_core(w: DistributedWorker) -> None:
    plan = plan_cores(1, len(allowed_cores()) - 1)
    assert w.stats()["child_threads"] == len(allowed_cores()) - 1
    assert os.sched_getaffinity(w.child_pids[0]) == set(plan.children[0])
    assert w._doorbell.spin_s == w.spin_wait_s


def layout_metric(w: DistributedWorker) -> dict[str, float]:
    """The info metric's series: layout -> value."""
    return {layout: w.engine.metrics.value("l3worker:cpu_layout_info", {"layout": layout})
            for layout in ("every_core", "spare_core")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
def test_default_layout_is_timed_at_start_up_and_the_child_runs_as_chosen(ckpt: Path) -> None:
    if len(allowed_cores()) < 2:
        pytest.skip("one core: nothing to choose")
    with DistributedWorker(ckpt, **{**COMMON, "num_threads": None}) as w:
        s = w.stats()
        assert set(s["cpu_layout_step_s"]) == {"every_core", "spare_core"}
        assert all(t > 0 for times in s["cpu_layout_step_s"].values() for t in times.values())
        assert s["cpu_layout_trial_s"] > 0
        assert s["cpu_layout_preferred"] == "spare_core"  # a model of a few thousand weights
        (assert_every_core if s["cpu_layout"] == "every_core" else assert_spare_core)(w)
        other = "spare_core" if s["cpu_layout"] == "every_core" else "every_core"
        assert layout_metric(w) == {s["cpu_layout"]: 1.0, other: 0.0}
        if not any(name in os.environ for name in environment.OMP_WAIT_VARIABLES):
            assert child_env(w.child_pids[0])["GOMP_SPINCOUNT"] == str(environment.CHILD_GOMP_SPINCOUNT)
        tokens = w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids
    with DistributedWorker(ckpt, **COMMON) as w:  # num_threads given: no trial, the layout its threads make
        s = w.stats()
        assert s["cpu_layout_step_s"] is None and s["cpu_layout_preferred"] is None
        assert s["cpu_layout"] == "spare_core" and layout_metric(w)["spare_core"] == 1.0
        assert w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids == tokens


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
def test_auto_preferring_every_core_starts_and_runs_as_that_layout_fixed(ckpt: Path, monkeypatch) -> None:
    """The rule prefers every core (the threshold lowered for the test's small model): the child
    starts unpinned on every core, and whatever the trial keeps, every thread, the child's and
    the parent's socket threads included, ends where a worker with that layout fixed puts it."""
    if len(allowed_cores()) < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setattr(cpu_layout, "EVERY_CORE_MIN_WEIGHTS", 0)
    parent_before = set(zmq_threads(os.getpid()))
    with DistributedWorker(ckpt, **{**COMMON, "num_threads": None}) as w:
        s = w.stats()
        assert s["cpu_layout_preferred"] == "every_core"
        parent_io = set(zmq_threads(os.getpid())) - parent_before
        child_io = zmq_threads(w.child_pids[0])
        if s["cpu_layout"] == "every_core":
            assert_every_core(w)
            sockets = set(allowed_cores()[1:])  # off the step thread's core
        else:  # other processes kept the machine busy through the trial
            assert_spare_core(w)
            sockets = set(plan_cores(1, len(allowed_cores()) - 1).service)
        assert parent_io and child_io
        assert all(os.sched_getaffinity(t) == sockets for t in [*parent_io, *child_io])
        assert w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
def test_explicit_layouts_are_not_timed_and_are_reported(ckpt: Path) -> None:
    if len(allowed_cores()) < 2:
        pytest.skip("one core: both layouts are one thread")
    options = {**COMMON, "num_threads": None}
    with DistributedWorker(ckpt, **options, cpu_layout="every_core") as w:
        assert w.stats()["cpu_layout"] == "every_core" and w.stats()["cpu_layout_step_s"] is None
        assert layout_metric(w) == {"every_core": 1.0, "spare_core": 0.0}
        assert_every_core(w)
    with DistributedWorker(ckpt, **options, cpu_layout="spare_core") as w:
        assert w.stats()["cpu_layout"] == "spare_core" and w.stats()["cpu_layout_step_s"] is None
        assert layout_metric(w) == {"every_core": 0.0, "spare_core": 1.0}
        assert_spare_core(w)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
def test_a_restart_forked_from_threads_kept_off_the_step_core_gets_every_core_again(ckpt: Path) -> None:
    """A serving process moves its threads off the step core after the first start (the engine
    core, the API server): the child that a restart forks from them must still get every core,
    its thread count and its step core as the first had."""
    cores = allowed_cores()
    if len(cores) < 2:
        pytest.skip("one core: no core of its own for the step thread")
    options = {**COMMON, "num_threads": None, "cpu_layout": "every_core"}
    with DistributedWorker(ckpt, **options, pin_cores=False) as unpinned:
        assert unpinned.step_core is None and unpinned.stats()["cpu_step_core"] is None
        want = unpinned.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids
    with DistributedWorker(ckpt, **options, fault_injection="exit@3") as w:  # the first child dies at step 3
        assert_every_core(w)
        first = w.child_pids[0]
        with DistributedWorker(ckpt, **options) as second:  # its step thread would share the first's core
            assert second.step_core is None
        try:
            assert device.move_threads_off(w.step_core) == cores[1:]
            assert all(os.sched_getaffinity(t) == set(cores[1:]) for t in device.process_threads())
            got = w.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids
            assert w.engine.metrics.value("l3worker:engine_restarts_total") == 1 and w.child_pids[0] != first
            assert_every_core(w, cores)
        finally:
            device.pin_threads(lambda *_: cores)  # this test process's threads, as they were
        assert got == want  # pinned or not, restarted or not: the same tokens


def test_cpu_layout_is_validated(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="cpu_layout"):
        DistributedWorker(ckpt, **{**COMMON, "num_threads": None}, cpu_layout="all")
    with pytest.raises(ValueError, match="cpu_layout='every_core' and num_threads=1"):
        DistributedWorker(ckpt, **COMMON, cpu_layout="every_core")


def test_layout_threads(monkeypatch) -> None:
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(8)))
    assert device.default_cpu_threads(1, "every_core") == 8 and device.default_cpu_threads(2, "every_core") == 4
    assert device.default_cpu_threads(1, "spare_core") == 7 and device.default_cpu_threads(2) == 3
    with pytest.raises(ValueError, match="cpu_layout"):
        device.default_cpu_threads(1, "auto-ish")


def test_the_users_openmp_wait_settings_win() -> None:
    assert environment.child_environment({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
    assert environment.child_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
    assert environment.child_environment({}) == {"GOMP_SPINCOUNT": str(environment.CHILD_GOMP_SPINCOUNT)}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
@pytest.mark.usefixtures("sole_worker")
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


def test_accelerator_children_are_not_pinned_nor_timed(ckpt: Path) -> None:
    w = DistributedWorker(ckpt, **{**COMMON, "device": "cuda", "num_threads": None})
    assert w._placement.threads(1) is None and w._plan_cores() is None
    assert w._placement.trial(others_pinned=False) is None
    assert w.cpu_layout_in_use is None  # no cpu children: no layout, and no metric series


def placement(**fields) -> CpuPlacement:
    return CpuPlacement(**{**dict(layout="auto", num_threads=None, pin_cores=True, on_cpu=True,
                                  step_weights=cpu_layout.EVERY_CORE_MIN_WEIGHTS, tensor_parallel_size=1,
                                  reachable_positions=64), **fields})


def test_tensor_parallel_cpu_children_keep_a_core_spare_untimed(monkeypatch) -> None:
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(8)))
    monkeypatch.setattr(cpu_placement, "allowed_cores", lambda: list(range(8)))
    tp = placement(tensor_parallel_size=2)
    assert tp.trial(others_pinned=False) is None and tp.threads(2) == 3
    assert placement(reachable_positions=2).trial(others_pinned=False) is None  # no room for the timed steps


@pytest.mark.parametrize("weights, start", [(cpu_layout.EVERY_CORE_MIN_WEIGHTS, "every_core"),
                                            (cpu_layout.EVERY_CORE_MIN_WEIGHTS - 1, "spare_core")])
def test_auto_starts_as_the_fixed_preferred_layout_would(monkeypatch, weights: int, start: str) -> None:
    """The first start sets up the rule's layout exactly as that layout fixed does (threads, core
    plan), and the trial gets both layouts' cores."""
    for module in (device, cpu_placement):
        monkeypatch.setattr(module, "allowed_cores", lambda: [0, 1])
    auto, fixed = placement(step_weights=weights), placement(layout=start)
    assert auto.start_layout() == start
    assert (auto.threads(1), auto.plan(1, False)) == (fixed.threads(1), fixed.plan(1, False))
    assert auto.trial(others_pinned=False) == {"preferred": start, "every": [0, 1], "spare": [1], "service": [0]}
    # pinned by another worker of this process, or pin_cores=False: spare_core pins nothing
    assert auto.trial(others_pinned=True) == {"preferred": start, "every": [0, 1], "spare": [0, 1], "service": []}
    assert fixed.trial(others_pinned=False) is None  # a layout asked for is not timed


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_a_changed_choice_moves_the_parents_socket_threads_and_restarts_keep_it(monkeypatch) -> None:
    import zmq

    cores = allowed_cores()
    if len(cores) < 2:
        pytest.skip("one core: nothing to choose")
    auto = placement()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    try:
        sockets = [tid for tid, name in device.process_threads().items() if device.is_socket_thread(name)]
        trial = auto.trial(others_pinned=False)
        assert trial["preferred"] == "every_core"
        auto.started(trial, "spare_core")  # the trial saw a loaded machine
        assert all(os.sched_getaffinity(t) == set(trial["service"]) for t in sockets)
        assert auto.chosen == "spare_core" and auto.start_layout() == "spare_core"
        assert auto.trial(others_pinned=False) is None  # a restart is not timed
        assert auto.threads(1) == len(cores) - 1
    finally:
        for tid in sockets:
            os.sched_setaffinity(tid, cores)
        sock.close()
        ctx.term()


def test_pin_cores_must_be_a_bool(ckpt: Path) -> None:
    with pytest.raises(TypeError, match="pin_cores"):
        DistributedWorker(ckpt, **COMMON, pin_cores="yes")


def test_core_plan_leaves_a_core_over_or_pins_nothing(monkeypatch) -> None:
    monkeypatch.setattr(device, "allowed_cores", lambda: list(range(8)))
    assert plan_cores(2, 3) == CorePlan(service=[0, 1], children=[[2, 3, 4], [5, 6, 7]])
    assert plan_cores(1, 4) == CorePlan(service=[0, 1, 2, 3], children=[[4, 5, 6, 7]])
    assert plan_cores(2, 4) is None  # the children would take every core
    assert plan_cores(2, None) == CorePlan(service=[0, 1], children=[[2, 3, 4], [5, 6, 7]])  # spare_core's 3 each
    monkeypatch.setattr(device, "allowed_cores", lambda: [0])
    assert plan_cores(1, None) is None


def test_the_step_core_is_the_first_core_of_a_lone_child_on_every_core(monkeypatch) -> None:
    monkeypatch.setenv(cpu_placement.CORE_CLAIMS_ENV, f"l3worker-unit-{os.getpid()}")
    for module in (device, cpu_placement):
        monkeypatch.setattr(module, "allowed_cores", lambda: [2, 3, 5])

    def step_core(children: int = 1, others_pinned: bool = False, **fields) -> int | None:
        p = placement(**fields)
        try:
            return p.step_core(children, others_pinned)
        finally:
            p.release()

    assert step_core(layout="every_core") == 2
    assert step_core() == 2  # auto with a trial: the child keeps it if it keeps every core
    assert step_core(layout="spare_core") is None
    assert step_core(layout="every_core", pin_cores=False) is None
    assert step_core(layout="every_core", on_cpu=False) is None
    assert step_core(others_pinned=True, layout="every_core") is None  # another worker of this process pinned
    assert step_core(2, layout="every_core") is None  # two children: no core to spare for each
    assert step_core(layout="every_core", tensor_parallel_size=2) is None
    assert step_core(chosen="spare_core") is None  # a restart after the trial chose spare_core
    # One worker on the machine holds it; a restart keeps it; a child that did not take it frees it.
    first = placement(layout="every_core")
    assert first.step_core(1, False) == 2
    assert step_core(layout="every_core") is None
    assert first.step_core(1, False) == 2
    first.started(None, None, step_core=None)
    assert step_core(layout="every_core") == 2
    # The cores it was made with count, whatever this thread's mask became since.
    every = placement(layout="every_core")
    monkeypatch.setattr(device, "allowed_cores", lambda: [3, 5])
    monkeypatch.setattr(cpu_placement, "allowed_cores", lambda: [3, 5])
    assert every.threads(1) == 3 and every.step_core(1, False) == 2
    every.release()
    monkeypatch.setattr(cpu_placement, "allowed_cores", lambda: [0])
    assert step_core(layout="every_core") is None  # one core


def test_a_step_core_is_claimed_once_on_the_machine(monkeypatch) -> None:
    """The claim is an abstract socket name: a second claim fails in this process and in another,
    and it is free again once the socket is closed."""
    import subprocess
    import sys

    monkeypatch.setenv(cpu_placement.CORE_CLAIMS_ENV, f"l3worker-claims-{os.getpid()}")
    first, other = cpu_placement.claim_core(3), cpu_placement.claim_core(4)
    try:
        assert first is not None and other is not None and cpu_placement.claim_core(3) is None
        code = "import sys; from l3worker.worker.cpu_placement import claim_core; sys.exit(claim_core(3) is not None)"
        assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], timeout=120).returncode == 0
    finally:
        first.close()
        other.close()
    again = cpu_placement.claim_core(3)
    assert again is not None
    again.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_threads_the_step_thread_starts_later_are_moved_off_its_core() -> None:
    """A thread started by the step thread after pin_step_thread inherits its one core (a lazily made
    pool); keep_off_step_core, which the child's step loop calls every KEEP_OFF_EVERY steps, moves it
    to the rest and leaves the step thread where it is."""
    import threading

    cores = allowed_cores()
    if len(cores) < 2:
        pytest.skip("one core: no core of its own for the step thread")
    stop, late = threading.Event(), None
    try:
        assert device.pin_step_thread(cores[0], cores)  # this thread is the step thread
        late = threading.Thread(target=stop.wait)
        late.start()
        assert os.sched_getaffinity(late.native_id) == {cores[0]}
        device.keep_off_step_core(cores[0], cores[1:])
        assert os.sched_getaffinity(late.native_id) == set(cores[1:])
        assert os.sched_getaffinity(0) == {cores[0]}
    finally:
        stop.set()
        if late is not None:
            late.join()
        device.pin_threads(lambda *_: cores)  # this test process's threads, as they were
