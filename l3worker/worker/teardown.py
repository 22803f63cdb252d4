"""Teardown that frees everything it can: a close must not leak what its later steps release
(children, sockets, shared memory) because an earlier step raised."""
from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Iterable

log = logging.getLogger("l3worker.worker.teardown")


def run_every(steps: Iterable[Callable[[], object] | None]) -> None:
    """Runs each step in order, on past any that raises, then raises the first error; a later one is
    logged. None steps are skipped."""
    first: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised once every step has run
            if first is None:
                first = exc
            else:
                log.warning("teardown step %s failed too: %r", getattr(step, "__qualname__", step), exc)
    if first is not None:
        raise first


# Every prepared worker of this process: the exit hook closes them, and a worker's CPU placement
# looks at which cores the others hold.
live_workers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    """A program that forgets close() still stops its children on a normal exit."""
    run_every(worker.close for worker in list(live_workers))
