"""Robustness under faults, through the public API with real processes.

The parent dying without close(), Ctrl-C in the API and in the example, a child that raises,
hangs or exits inside a step, garbled commands reaching a child, and two workers side by side in
one process. Every test checks that no child, socket directory or /dev/shm entry is left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest

from fault_helpers import GUARD_S, alive, assert_nothing_left, guard, shm_entries, wait_for
from l3worker import ChildDiedError, ChildError, DistributedWorker, SamplingParams, StepTimeoutError, WorkerError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "npu_generate.py"
SMALL = {"device": "cpu", "max_batch_size": 2, "max_seq_len": 64, "page_size": 8, "num_threads": 1}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [200, 17, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)


# -- helpers ---------------------------------------------------------------------------------------
def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


class Script:
    """A subprocess whose stdout/stderr go to files, so that orphaned grandchildren holding them
    never block the test; lines are read by polling."""

    def __init__(self, tmp: Path, argv: list[str]):
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.PIPE, text=True, cwd=REPO)

    def go(self) -> None:
        """Releases a script waiting on its stdin."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def lines(self) -> list[str]:
        text = self.out.read_text()
        return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]

    def wait_line(self, pred: Callable[[str], bool], timeout_s: float = GUARD_S) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.lines():
                if pred(line):
                    return line
            if self.proc.poll() is not None and not any(pred(line) for line in self.lines()):
                pytest.fail(f"script exited with {self.proc.returncode} before the expected line; "
                            f"stdout:\n{self.out.read_text()}\nstderr:\n{self.err.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no expected line within {timeout_s}s; stdout:\n{self.out.read_text()}")
            time.sleep(0.05)

    def wait(self, timeout_s: float = GUARD_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"script still running after {timeout_s}s; stderr:\n{self.err.read_text()}")

    def stderr(self) -> str:
        return self.err.read_text()


@pytest.fixture
def reaper() -> Iterator[list]:
    """Processes and dirs a test registers; whatever a failing test left is removed afterwards."""
    things: list = []
    yield things
    for thing in things:
        if isinstance(thing, subprocess.Popen):
            if thing.poll() is None:
                thing.kill()
                thing.wait()
            if thing.stdin is not None:
                thing.stdin.close()
        elif isinstance(thing, psutil.Process) and alive(thing):
            thing.kill()
        elif isinstance(thing, str) and os.path.isdir(thing):
            shutil.rmtree(thing, ignore_errors=True)


# A throwaway parent: prepares a worker, prints its children and socket dir, then does `mode` once
# the test has recorded them and released it.
PARENT_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import psutil
    from l3worker import DistributedWorker, SamplingParams

    mode = sys.argv[1]
    w = DistributedWorker(device="cpu", max_batch_size=2, max_seq_len=4096, page_size=64, num_threads=1)
    w.prepare()
    pids, socket_dir = w.child_pids, w.socket_dir
    print(json.dumps({"pids": pids, "socket_dir": socket_dir}), flush=True)
    sys.stdin.readline()
    long = SamplingParams(max_new_tokens=4000, ignore_eos=True)
    if mode == "sleep":
        time.sleep(600)
    elif mode == "exit":
        sys.exit(0)
    elif mode == "os_exit":
        os._exit(0)
    elif mode == "generate":
        print("generating", flush=True)
        w.generate([[1, 2, 3]], long)
        print("done", flush=True)
    elif mode == "sigint":
        child = psutil.Process(pids[0])

        def interrupt():  # once the child is visibly decoding, Ctrl-C ourselves
            busy = sum(child.cpu_times()[:2])
            while sum(child.cpu_times()[:2]) < busy + 0.3:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        try:
            w.generate([[1, 2, 3], [4, 5]], long)
            outcome = "completed"
        except KeyboardInterrupt:
            outcome = "interrupted"
        print(json.dumps({"outcome": outcome, "state": w.stats()["state"], "child_pids": w.child_pids,
                          "socket_dir": w.socket_dir}), flush=True)
""")


def _start_parent(tmp: Path, mode: str, reaper: list) -> tuple[Script, list[psutil.Process], str]:
    script = Script(tmp, [sys.executable, "-c", PARENT_SCRIPT, mode])
    reaper.append(script.proc)
    info = json.loads(script.wait_line(lambda line: line.startswith("{")))
    children = [psutil.Process(pid) for pid in info["pids"]]
    reaper.extend(children)
    reaper.append(info["socket_dir"])
    assert all(alive(p) for p in children) and os.path.isdir(info["socket_dir"])
    script.go()
    return script, children, info["socket_dir"]


# -- the parent dies without close() ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sleep", "exit", "os_exit"])
def test_parent_death_releases_children(mode: str, tmp_path: Path, reaper: list) -> None:
    shm_before = shm_entries()
    script, children, socket_dir = _start_parent(tmp_path, mode, reaper)
    if mode == "sleep":
        script.proc.send_signal(signal.SIGKILL)
        assert script.wait() == -signal.SIGKILL
    else:
        assert script.wait() == 0, script.stderr()
    assert_nothing_left(children, socket_dir, shm_before)


def test_parent_killed_during_generate(tmp_path: Path, reaper: list) -> None:
    shm_before = shm_entries()
    script, children, socket_dir = _start_parent(tmp_path, "generate", reaper)
    script.wait_line(lambda line: line == "generating")
    start = _cpu_s(children[0])
    assert wait_for(lambda: _cpu_s(children[0]) > start + 0.3, GUARD_S), "the child never started decoding"
    script.proc.send_signal(signal.SIGKILL)
    assert script.wait() == -signal.SIGKILL
    assert "done" not in script.lines(), "generate finished before the kill; make it longer"
    assert_nothing_left(children, socket_dir, shm_before)


# The parent kills itself as soon as its chip-child exists: the child is still importing torch.
KILLED_WHILE_STARTING = textwrap.dedent("""
    import json, os, signal, threading, time
    import psutil
    from l3worker import DistributedWorker

    def kill_once_the_child_exists():
        while True:
            for p in psutil.Process().children():
                cmd = p.cmdline()
                if "chip_child" in cmd:
                    print(json.dumps({"pid": p.pid, "socket_dir": json.loads(cmd[-1])["socket_dir"]}), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.005)

    threading.Thread(target=kill_once_the_child_exists, daemon=True).start()
    DistributedWorker(device="cpu", max_batch_size=2, max_seq_len=64, page_size=8, num_threads=1).prepare()
""")


def test_parent_killed_while_its_child_starts(tmp_path: Path, reaper: list) -> None:
    """A child orphaned before it serves removes the socket directory too (the parent bound its
    socket there), as one orphaned later does."""
    shm_before = shm_entries()
    script = Script(tmp_path, [sys.executable, "-c", KILLED_WHILE_STARTING])
    reaper.append(script.proc)
    info = json.loads(script.wait_line(lambda line: line.startswith("{")))
    child = psutil.Process(info["pid"])
    reaper.extend([child, info["socket_dir"]])
    assert script.wait() == -signal.SIGKILL
    assert_nothing_left([child], info["socket_dir"], shm_before)


# -- Ctrl-C ------------------------------------------------------------------------------------------
def test_ctrl_c_during_generate_closes_worker(tmp_path: Path, reaper: list) -> None:
    shm_before = shm_entries()
    script, children, socket_dir = _start_parent(tmp_path, "sigint", reaper)
    assert script.wait() == 0, script.stderr()
    result = json.loads(script.lines()[-1])
    assert result == {"outcome": "interrupted", "state": "closed", "child_pids": [], "socket_dir": None}
    # close() ran before KeyboardInterrupt reached the caller, so nothing needs polling for.
    assert not any(alive(p) for p in children)
    assert not os.path.exists(socket_dir)
    assert_nothing_left(children, socket_dir, shm_before)


def test_ctrl_c_to_example_exits_130(tmp_path: Path, reaper: list) -> None:
    shm_before = shm_entries()
    script = Script(tmp_path, [sys.executable, str(EXAMPLE), "--device", "cpu", "--num-prompts", "1",
                               "--max-seq-len", "4096", "--max-new-tokens", "4000", "--ignore-eos"])
    reaper.append(script.proc)
    script.wait_line(lambda line: line.startswith("[setup]"))
    children = psutil.Process(script.proc.pid).children(recursive=True)
    reaper.extend(children)
    assert children, "the example has no child processes after its [setup] line"
    socket_dirs = {json.loads(c.cmdline()[-1])["socket_dir"] for c in children}  # the chip-child's spec
    reaper.extend(socket_dirs)
    script.proc.send_signal(signal.SIGINT)
    assert script.wait() == 130, f"stdout:\n{script.out.read_text()}\nstderr:\n{script.stderr()}"
    assert "interrupted" in script.out.read_text() + script.stderr()
    assert "finish_reason" not in script.out.read_text(), "generate finished before the SIGINT; make it longer"
    # The example closed its worker before exiting, so nothing needs polling for but /dev/shm.
    assert not any(alive(p) for p in children), "children outlived the example"
    assert not any(os.path.exists(d) for d in socket_dirs), f"socket dir left behind: {socket_dirs}"
    assert wait_for(lambda: not (shm_entries() - shm_before)), f"new /dev/shm entries: {sorted(shm_entries() - shm_before)}"


# -- a child fails inside a step ---------------------------------------------------------------------
def _faulty_worker(fault: str, **overrides) -> tuple[DistributedWorker, list[psutil.Process], str]:
    """No restarts: the failure reaches the caller, as it did before restarts existed."""
    w = DistributedWorker(**{**SMALL, "max_restarts": 0, **overrides}, fault_injection=fault).prepare()
    return w, [psutil.Process(pid) for pid in w.child_pids], w.socket_dir


@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_child_raises_gives_child_error_with_traceback(overlap: bool) -> None:
    shm_before = shm_entries()
    w, children, socket_dir = _faulty_worker("raise@2", overlap_steps=overlap)
    with guard(), pytest.raises(ChildError) as err:
        w.generate(PROMPTS, GREEDY)
    assert "injected fault" in str(err.value)
    assert "Traceback" in str(err.value)
    assert w.stats()["state"] == "closed"
    w.close()  # idempotent after the failure
    assert_nothing_left(children, socket_dir, shm_before)
    with pytest.raises(WorkerError, match="closed"):
        w.generate(PROMPTS, GREEDY)


def test_child_hangs_gives_step_timeout() -> None:
    shm_before = shm_entries()
    w, children, socket_dir = _faulty_worker("hang@2", step_timeout_s=2)
    t0 = time.monotonic()
    with guard(), pytest.raises(StepTimeoutError, match="2s"):
        w.generate(PROMPTS, GREEDY)
    # the 2 s timeout plus close()'s grace for a child that ignores Shutdown; hours would be the bug
    assert time.monotonic() - t0 < 30
    w.close()
    assert_nothing_left(children, socket_dir, shm_before)


def test_child_exits_gives_child_died_error() -> None:
    shm_before = shm_entries()
    w, children, socket_dir = _faulty_worker("exit@2")
    with guard(), pytest.raises(ChildDiedError, match="exited with code 3"):
        w.generate(PROMPTS, GREEDY)
    w.close()
    assert_nothing_left(children, socket_dir, shm_before)


# -- garbled commands reaching a child ---------------------------------------------------------------
def _triple(row: int, block: int, page: int) -> bytes:
    return np.array([row, block, page], np.int32).tobytes()


def _chunk(start: int, length: int, offset: int) -> bytes:
    return np.array([0, start, length, offset, 1], np.int32).tobytes()


def test_garbled_commands_are_refused_and_leave_state_intact() -> None:
    shm_before = shm_entries()
    with guard(), DistributedWorker(**SMALL) as w:
        children, socket_dir = [psutil.Process(pid) for pid in w.child_pids], w.socket_dir
        before = [o.token_ids for o in w.generate(PROMPTS, [GREEDY, SEEDED])]
        lim = w.runtime_config.limits()
        b, mb, pages, cap = lim.max_batch_size, lim.max_blocks_per_row, lim.num_pages, lim.max_prefill_tokens
        cases = {
            "undecodable": (b"\xc1\xc1\xc1", "undecodable command"),
            "truncated": (msgpack.packb([0, 5, [], b""])[:-2], "undecodable command"),
            "unknown op": (msgpack.packb([7, 5, [], b""]), "unknown op"),
            "not an array": (msgpack.packb({"op": 0}), "unknown op"),
            "finished row out of range": (msgpack.packb([0, 5, [b], b""]), f"row {b} outside"),
            "page triple row out of range": (msgpack.packb([0, 5, [], _triple(b, 0, 1)]), f"row {b} outside"),
            "page id 0": (msgpack.packb([0, 5, [], _triple(0, 0, 0)]), "page id outside"),
            "page id num_pages": (msgpack.packb([0, 5, [], _triple(0, 0, pages)]), "page id outside"),
            "block index out of range": (msgpack.packb([0, 5, [], _triple(0, mb, 1)]), "block index outside"),
            "chunk staging beyond capacity":
                (msgpack.packb([1, 5, [], b"", [], _chunk(0, 4, cap - 2)]), "staging range outside"),
            "chunk past max_seq_len":
                (msgpack.packb([1, 5, [], b"", [], _chunk(lim.max_seq_len - 1, 2, 0)]), "outside"),
        }
        child = w._children[0]
        for name, (raw, expected) in cases.items():
            child.send(raw)
            with pytest.raises(ChildError, match=expected):
                child.recv(5, "test")
            assert child.proc.poll() is None, f"child died on {name}"
        after = [o.token_ids for o in w.generate(PROMPTS, [GREEDY, SEEDED])]
        assert after == before
        assert w.stats()["kv_pages_free"] == w.stats()["kv_pages_total"]
    assert_nothing_left(children, socket_dir, shm_before)


# -- two workers in one process ----------------------------------------------------------------------
def test_two_workers_side_by_side() -> None:
    shm_before = shm_entries()
    calls = [(PROMPTS, GREEDY), ([[5, 6, 7], [8], [9, 10, 11, 12]], SEEDED), ([[42] * 20], GREEDY)]
    with guard():
        a = DistributedWorker(**SMALL).prepare()
        solo_a = [[o.token_ids for o in a.generate(p, s)] for p, s in calls]
        b = DistributedWorker(**{**SMALL, "max_batch_size": 3, "page_size": 16}).prepare()
        try:
            solo_b = [[o.token_ids for o in b.generate(p, s)] for p, s in calls]
            assert a.socket_dir != b.socket_dir
            assert not set(a.child_pids) & set(b.child_pids)
            for _ in range(2):
                for i, (p, s) in enumerate(calls):
                    assert [o.token_ids for o in a.generate(p, s)] == solo_a[i]
                    assert [o.token_ids for o in b.generate(p, s)] == solo_b[i]
            a_children, a_dir = [psutil.Process(pid) for pid in a.child_pids], a.socket_dir
            a.close()
            assert not any(alive(p) for p in a_children) and not os.path.exists(a_dir)
            assert os.path.isdir(b.socket_dir) and all(alive(psutil.Process(pid)) for pid in b.child_pids)
            for i, (p, s) in enumerate(calls):
                assert [o.token_ids for o in b.generate(p, s)] == solo_b[i]
            b_children, b_dir = [psutil.Process(pid) for pid in b.child_pids], b.socket_dir
        finally:
            a.close()
            b.close()
    assert_nothing_left(a_children + b_children, b_dir, shm_before)


# -- a step of close() raises ------------------------------------------------------------------------
@pytest.mark.parametrize("broken", ["engine.request_stop", "engine.input_processor.grammars.close"])
def test_close_frees_everything_when_one_of_its_steps_raises(broken: str, monkeypatch) -> None:
    """The first of close()'s steps, or one between stopping the children and freeing the sockets:
    the error reaches the caller, and still no child, socket directory or shared memory is left."""
    shm_before = shm_entries()
    w = DistributedWorker(**SMALL).prepare()
    children, socket_dir = [psutil.Process(pid) for pid in w.child_pids], w.socket_dir
    owner_path, name = broken.rsplit(".", 1)
    owner = w
    for part in owner_path.split("."):
        owner = getattr(owner, part)

    def fail() -> None:
        raise RuntimeError(f"{broken} failed")

    monkeypatch.setattr(owner, name, fail)
    with guard(), pytest.raises(RuntimeError, match=f"{broken} failed"):
        w.close()
    assert w.stats()["state"] == "closed" and w.child_pids == [] and w.socket_dir is None
    assert_nothing_left(children, socket_dir, shm_before)
    monkeypatch.undo()
    w.close()  # quiet the second time
    with pytest.raises(WorkerError, match="closed"):
        w.generate(PROMPTS, GREEDY)
