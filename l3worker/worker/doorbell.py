"""Waiting for a step: shared memory first, a kernel wake-up only when the parent would sleep.

The leader child writes a step's sampled ids and figures into its ring slot, then stores
`steps completed` into the doorbell, then adds 1 to an eventfd it inherited. A parent that
expects the step soon spins on that word; one that would wait longer sleeps in a poll of the
eventfd and the children's sockets (error replies come by socket). The eventfd costs the child
one syscall a step and wakes the parent directly: no socket thread on either side runs, where a
ZeroMQ wake-up message costs the sender tens of microseconds and wakes four threads, a few
percent of a small model's step on a machine whose cores the child's threads fill. Written
after every step, it cannot be lost to a race; a count left from steps nobody slept on only
makes the next poll return at once, after which the parent reads the word again.

Where the OS has no eventfd, the child sends a ZeroMQ wake-up message instead, only to a parent
that stored the step it sleeps on in the second word; a wake-up lost to the race between those
two stores is recovered by the liveness poll. A child that sent an error reply raises the third
word, so a parent never reads a later step's completion past a failed or refused one. When
fresh children replace failed ones, the engine resets the words before their first step (see
Engine._recover).

A wait for a step with others before it still to complete (the engine reads several at once with
stream_interval) first sleeps through those, at the mean step time its earlier waits measured, so
that the eventfd of each does not wake it.

Spinning reads the ring after the doorbell without a fence, which x86's ordered stores make
safe; elsewhere the parent never spins (and without an eventfd the children send a wake-up
after every step).
"""
from __future__ import annotations

import os
import platform
import threading
import time

import numpy as np
import zmq

from l3worker.worker.child_process import LIVENESS_POLL_MS, ChildProcess, check_cancel
from l3worker.errors import StepTimeoutError

NAP_MARGIN_S = 0.0003
MAX_NAP_S = 0.05  # a nap sees no failure: one that outlasts this is noticed this late at most
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def make_wake_fd() -> int | None:
    """The eventfd the leader child writes after every step (None where the OS has none: then
    it sends wake-up messages). The parent closes it."""
    if not hasattr(os, "eventfd"):
        return None
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class Doorbell:
    def __init__(self, word: np.ndarray, children: list[ChildProcess], spin_s: float,
                 cancel: threading.Event | None = None, wake_fd: int | None = None):
        self.word = word  # [steps completed, step the parent sleeps on or -1, error reply pending]
        self.children = children
        self.wake_fd = wake_fd
        self.cancel = cancel  # set: the engine is stopping, so a sleeping wait gives up
        self.spin_s = spin_s if ORDERED_STORES else 0.0
        self._expected_s = 0.0  # running mean of how long a wait lasted
        self._step_s = 0.0  # running mean of a step's time, from waits that saw several steps complete
        self.poller = zmq.Poller()
        for child in children:
            self.poller.register(child.sock, zmq.POLLIN)  # error replies (and wake-ups without wake_fd)
        if wake_fd is not None:
            self.poller.register(wake_fd, zmq.POLLIN)

    def done(self, step: int) -> bool:
        """`step` completed, and no error reply waits (wait() raises that one)."""
        return self.word[0] > step and not self.word[2]

    def wait(self, step: int, timeout_s: float | None, queued_behind: bool = False) -> None:
        """Returns once `step` completed; raises if a child failed, died or timed out.
        `queued_behind`: the child already holds the next command, so waking late costs nothing."""
        if self.done(step):
            return
        word = self.word
        t0, first = time.perf_counter(), int(word[0])
        if step > first and self._step_s:
            # Steps complete before this one (stream_interval reads several at once): sleep through
            # them, where the eventfd would wake this thread at each, preempting a child's thread.
            time.sleep(min((step - first) * self._step_s, MAX_NAP_S))
        elif queued_behind and self.spin_s and self._expected_s > 2 * NAP_MARGIN_S:
            # Nap through most of the expected wait: an idle core is where the children's socket
            # threads wake, instead of preempting a child's step (3 to 8% of a small model's).
            time.sleep(min(self._expected_s - NAP_MARGIN_S, self.spin_s))
        spin_until = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_until and not word[2]:
            if word[0] > step:
                self._expected_s = 0.9 * self._expected_s + 0.1 * (time.perf_counter() - t0)
                self._timed(step + 1 - first, t0)
                return
        word[1] = step
        try:
            self._sleep(step, timeout_s)
        finally:
            word[1] = -1
        self._timed(step + 1 - first, t0)

    def _timed(self, steps: int, t0: float) -> None:
        """A wait saw `steps` complete since t0: with two or more, the child ran through whole
        steps meanwhile, and their mean time (a little under a step: the first was under way)
        feeds the estimate naps use."""
        if steps >= 2:
            each = (time.perf_counter() - t0) / steps
            self._step_s = each if not self._step_s else 0.8 * self._step_s + 0.2 * each

    def _sleep(self, step: int, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.word[0] <= step or self.word[2]:
            events = dict(self.poller.poll(LIVENESS_POLL_MS))
            if self.wake_fd in events:
                os.eventfd_read(self.wake_fd)  # clears the count: a later poll waits for a later step
            for child in self.children:
                if child.sock in events:
                    child.drain()  # wake-ups carry nothing; an error reply raises
            if not events:
                for child in self.children:
                    child.check_alive(f"step {step}")
                check_cancel(self.cancel)
                if deadline is not None and time.monotonic() > deadline:
                    raise StepTimeoutError(f"no chip-child completed step {step} within {timeout_s:g}s")
