"""The engine's gauges (running, waiting and queued requests), read by the metrics registry and by
submit's queue limit. They read copies: the engine-core process scrapes from a thread other than
the loop's."""
from __future__ import annotations

from collections import deque


def num_running(requests: dict) -> int:
    return sum(1 for s in list(requests.values()) if any(q.row >= 0 and not q.finished for q in s.seqs))


def num_waiting(requests: dict, inbox: deque) -> int:
    return sum(1 for s in list(requests.values()) if all(q.row < 0 and not q.finished for q in s.seqs)) + \
        _adds(inbox)


def num_queued(scheduler, inbox: deque) -> int:
    """Samples waiting for a row, cheaply (submit checks it under load)."""
    return (len(scheduler.waiting) if scheduler is not None else 0) + _adds(inbox)


def _adds(inbox: deque) -> int:
    """Requests in the inbox, not yet taken in by the loop."""
    return sum(1 for kind, _ in list(inbox) if kind == "add")
