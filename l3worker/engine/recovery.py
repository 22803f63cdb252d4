"""What the engine decides when its chip-children fail: whether to restart them, and which
requests to give up on.

A restart costs a pause, not the requests: the engine resumes every live request as a preempted
one (see Scheduler.requeue). It is bounded twice over. At most `max_restarts` restarts happen
within any `restart_window_s`; one more failure and the engine stops as it did before restarts
existed. And a request that crashes its child fails alone: every request running at a failure
becomes a suspect until it has produced the tokens the lost steps would have given it; suspects
resume one at a time (Scheduler._admit), and a request still a suspect at the next failure is
failed, while the others resume again. So a poison request ends alone, whatever the batch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from l3worker.engine.requests import RequestState

BLAME_AFTER = 2  # consecutive failures a request may be running at before it is failed alone


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # 0: a failure stops the engine, every live request lost
    restart_window_s: float = 600.0

    def validate(self) -> None:
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not isinstance(self.restart_window_s, (int, float)) or not self.restart_window_s > 0:
            raise ValueError(f"restart_window_s must be > 0 seconds, got {self.restart_window_s!r}")


class RestartBudget:
    """Counts restarts in a sliding window."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._times: deque[float] = deque()
        self.total = 0

    def take(self, now: float | None = None) -> bool:
        """Spends one restart; False when the window holds max_restarts already."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.policy.restart_window_s:
            self._times.popleft()
        if len(self._times) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        self.total += 1
        return True

    def describe(self) -> str:
        p = self.policy
        return f"restart {len(self._times)} of at most {p.max_restarts} within {p.restart_window_s:g}s"


def running(state: RequestState) -> bool:
    """Some sample sits in a batch row or has commands in flight."""
    return any(not s.finished and (s.row >= 0 or s.fed > 0) for s in state.seqs)


def blame(states: Iterable[RequestState], slack: int) -> list[RequestState]:
    """Counts a failure against each request running at it; returns those that were still
    suspects of the previous failure, and makes the rest of the running ones suspects until they
    have `slack` more tokens (the most the steps lost with the children could have given them)."""
    blamed = []
    for state in states:
        if not running(state):
            state.failures = 0
            continue
        state.failures = state.failures + 1 if any(s.suspect for s in state.seqs) else 1
        if state.failures >= BLAME_AFTER:
            blamed.append(state)
            continue
        for seq in state.seqs:
            seq.suspect_until = len(seq.tokens) + slack
    return blamed
