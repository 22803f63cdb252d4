"""A cpu chip-child started before its spec (l3worker/worker/early_child.py): handed its spec and
shared buffers over a socket pair, it serves exactly as a child started with them; one the launch
cannot use, or never hands anything, ends and leaves no process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest

from chip_child.child_spec import ChildSpec
from chip_child.spec_handover import receive_spec, send_spec
from fault_helpers import alive, wait_for
from l3worker import DistributedWorker, SamplingParams
from l3worker.worker.early_child import EarlyChild, surely_cpu

COMMON = dict(max_batch_size=2, max_seq_len=64, page_size=8, device="cpu", num_threads=1, step_timeout_s=60.0)
PROMPTS = [np.random.default_rng(3).integers(0, 300, n).tolist() for n in (5, 9)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("default")


def test_the_spec_arrives_with_its_descriptors_renumbered_to_the_ones_received() -> None:
    ours, theirs = socket.socketpair()
    read_end, write_end = os.pipe()
    spec = ChildSpec(rank=0, socket_dir="/nowhere", runtime={}, buffers={"sampled": [read_end, 64, [2, 4], "int32"]},
                     wake_fd=write_end)
    send_spec(ours, spec)
    ours.close()
    got = receive_spec(theirs)
    new_read, new_write = got.buffers["sampled"][0], got.wake_fd
    assert {new_read, new_write}.isdisjoint({read_end, write_end})
    assert got.buffers["sampled"][1:] == [64, [2, 4], "int32"] and got.rank == 0
    os.write(new_write, b"x")  # the received descriptors are the same pipe
    assert os.read(read_end, 1) == b"x"
    os.write(write_end, b"y")
    assert os.read(new_read, 1) == b"y"
    for fd in (read_end, write_end, new_read, new_write):
        os.close(fd)


def test_a_pair_closed_with_no_spec_reads_as_none() -> None:
    ours, theirs = socket.socketpair()
    ours.close()
    assert receive_spec(theirs) is None


def test_only_the_cpu_is_guessed_without_torch(monkeypatch) -> None:
    assert surely_cpu("cpu")
    assert not surely_cpu("cuda") and not surely_cpu("npu")
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert not surely_cpu("auto")  # an NVIDIA driver: torch may well find a GPU


def test_a_worker_hands_its_first_child_to_the_early_one_and_decodes_the_same(ckpt) -> None:
    with DistributedWorker(ckpt, **COMMON) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    w = DistributedWorker(ckpt, **COMMON)
    w.early_child = early = EarlyChild.start("cpu")
    try:
        assert early is not None
        child = psutil.Process(early.proc.pid)
        w.prepare()
        assert w.child_pids == [child.pid]  # no second process: the early one serves
        assert child.cmdline()[-1] == "--spec-on-stdin"
        assert os.getsid(child.pid) == child.pid  # a session (and scheduling autogroup) of its own, as any child
        assert [o.outputs[0].token_ids for o in w.generate(PROMPTS, GREEDY)] == expected
    finally:
        w.close()
    assert not alive(child)


def test_an_early_child_the_launch_cannot_use_is_ended(ckpt) -> None:
    early = EarlyChild.start("cpu")
    proc = early.proc
    assert early.usable("cpu", [0, 1]) is None  # two ranks: the launch starts its own
    assert proc.poll() is not None
    w = DistributedWorker(ckpt, **COMMON)
    w.early_child = early = EarlyChild.start("cpu")
    proc = early.proc
    w.close()  # never prepared: the early child goes with the worker
    assert proc.poll() is not None


def test_an_early_child_whose_parent_dies_exits_by_itself() -> None:
    """Its parent killed outright (no discard): the pair closes, and the child exits on its own
    once its imports are done, with nothing to release."""
    script = textwrap.dedent("""
        import os, sys
        from l3worker.worker.early_child import EarlyChild
        early = EarlyChild.start("cpu")
        print(early.proc.pid, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    child = psutil.Process(int(out.stdout.split()[0]))  # still importing torch: seconds from its end
    assert wait_for(lambda: not alive(child), 60), "the orphaned early child kept running"
