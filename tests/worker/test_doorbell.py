"""The doorbell's sleeping wait: the leader child's eventfd wakes the parent, with no socket message.

Unit tests drive Doorbell with stand-in children whose liveness check fails the test: a wait that
ends only because a liveness poll timed out would reach it. The worker test runs real children
with a parent that always sleeps (spin_wait_s=0) and counts the socket reads a wake-up costs.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import zmq

from l3worker import DistributedWorker, SamplingParams
from l3worker.worker import doorbell as doorbell_module
from l3worker.worker.doorbell import Doorbell, make_wake_fd

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the OS has no eventfd")


class WokenByTimeout(AssertionError):
    pass


class ReplyRead(Exception):
    pass


class StandInChild:
    """What Doorbell uses of a child: a socket to poll, drain() and check_alive()."""

    def __init__(self, ctx: zmq.Context, endpoint: str, liveness_fails: bool = True):
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.bind(endpoint)
        self.liveness_fails = liveness_fails

    def drain(self) -> None:
        self.sock.recv(zmq.NOBLOCK)
        raise ReplyRead()

    def check_alive(self, what: str) -> None:
        if self.liveness_fails:
            raise WokenByTimeout(f"the wait for {what} ended by its liveness poll, not by a wake-up")


@pytest.fixture
def bell(tmp_path: Path):
    """(doorbell, child stand-in, the child's end of its socket, the eventfd)."""
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/bell.sock"
    child = StandInChild(ctx, endpoint)
    peer = ctx.socket(zmq.PAIR)
    peer.connect(endpoint)
    fd = make_wake_fd()
    word = np.array([0, -1, 0], np.int64)
    try:
        yield Doorbell(word, [child], spin_s=0.0, wake_fd=fd), child, peer, fd
    finally:
        os.close(fd)
        peer.close(0)
        child.sock.close(0)
        ctx.term()


def wait_in_thread(bell: Doorbell, step: int) -> tuple[threading.Thread, list]:
    result: list = []

    def run() -> None:
        try:
            bell.wait(step, timeout_s=30.0)
            result.append("done")
        except BaseException as exc:  # reported to the test's thread
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def complete(bell: Doorbell, fd: int, step: int) -> None:
    """What the leader child does after a step: the word, then the eventfd."""
    bell.word[0] = step + 1
    os.eventfd_write(fd, 1)


def test_a_sleeping_wait_ends_on_the_eventfd(bell) -> None:
    doorbell, _, _, fd = bell
    thread, result = wait_in_thread(doorbell, 0)
    complete(doorbell, fd, 0)
    thread.join(30)
    assert result == ["done"]
    assert doorbell.word[1] == -1  # no longer asleep on a step


def test_a_count_left_by_earlier_steps_does_not_end_a_later_wait(bell) -> None:
    doorbell, child, _, fd = bell
    child.liveness_fails = False  # this wait outlasts a liveness poll
    for step in range(3):  # completed while nobody slept: their counts stay in the eventfd
        complete(doorbell, fd, step)
    thread, result = wait_in_thread(doorbell, 3)
    thread.join(0.3)
    assert thread.is_alive() and not result, f"the wait for step 3 ended before it completed: {result}"
    complete(doorbell, fd, 3)
    # Only now may a liveness poll fail: one between the two lines the other way round (a loaded
    # machine) ended the wait before the completion it was there to see.
    child.liveness_fails = True  # a wait the completion does not end fails by the next poll, not by a hang
    thread.join(30)
    assert result == ["done"]


def test_an_error_reply_still_ends_a_sleeping_wait(bell) -> None:
    doorbell, _, peer, _ = bell
    thread, result = wait_in_thread(doorbell, 0)
    peer.send(b"error")  # a failed step: the child replies by socket and completes nothing
    thread.join(30)
    assert len(result) == 1 and isinstance(result[0], ReplyRead)


def test_a_wait_several_steps_ahead_sleeps_through_the_steps_before_it(bell, monkeypatch) -> None:
    """Waiting for step 3 with steps 0-2 to go (stream_interval reads four at once), the parent naps
    through those at the step time its earlier waits measured, rather than being woken by each
    one's eventfd; the first such wait, with nothing measured yet, sleeps in the poll."""
    doorbell, _, _, fd = bell
    naps: list[float] = []
    reads: list[int] = []
    real_read = os.eventfd_read
    monkeypatch.setattr(doorbell_module.os, "eventfd_read", lambda f: reads.append(real_read(f)))

    def run_group(first: int, napping: bool) -> None:
        def nap(seconds: float) -> None:  # the steps before the last complete while the parent naps
            naps.append(seconds)
            for step in range(first, first + 3):
                complete(doorbell, fd, step)

        monkeypatch.setattr(doorbell_module.time, "sleep", nap)
        reads.clear()
        thread, result = wait_in_thread(doorbell, first + 3)
        while doorbell.word[1] != first + 3:  # asleep in the poll on the last step (after the nap, if any)
            thread.join(0.001)
        if not napping:
            for step in range(first, first + 3):
                complete(doorbell, fd, step)
        complete(doorbell, fd, first + 3)
        thread.join(30)
        assert result == ["done"]

    run_group(0, napping=False)
    assert naps == [] and doorbell._step_s > 0  # four steps seen complete in one wait: a step time
    step_s = doorbell._step_s
    run_group(4, napping=True)
    assert naps == [pytest.approx(min(3 * step_s, doorbell_module.MAX_NAP_S))]
    assert len(reads) <= 2  # the napped steps' counts read at once, then the last step's


def eventfds() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if _target(fd) == "anon_inode:[eventfd]")


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed meanwhile
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_sleeping_parent_reads_no_wakeup_message_and_close_releases_the_eventfd(make_checkpoint) -> None:
    before = eventfds()
    w = DistributedWorker(make_checkpoint("default"), max_batch_size=2, max_seq_len=64, page_size=8, device="cpu",
                          num_threads=1, spin_wait_s=0.0)
    reads, timed_out = [], []
    try:
        w.prepare()
        assert w._doorbell.spin_s == 0.0  # every wait sleeps
        for child in w._children:
            drain, check_alive = child.drain, child.check_alive
            child.drain = lambda drain=drain: (reads.append(1), drain())
            child.check_alive = lambda what, check=check_alive: (timed_out.append(what), check(what))
        outs = w.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [12, 12]
    finally:
        w.close()
    assert reads == []  # no wake-up message came by socket
    # and no wait for a step ended by its liveness poll: the eventfd woke every one
    assert not [what for what in timed_out if what.startswith("step ")]
    assert eventfds() == before
