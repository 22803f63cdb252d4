"""run_every: the helper behind DistributedWorker.close(), which must free everything it holds even
when one of its steps raises (test_faults.py checks that through a real worker)."""
from __future__ import annotations

import logging

import pytest

from l3worker.worker.teardown import run_every


def test_every_step_runs_in_order_and_the_first_error_is_raised(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def step(name: str, error: Exception | None = None):
        def run() -> None:
            ran.append(name)
            if error is not None:
                raise error
        return run

    with caplog.at_level(logging.WARNING, "l3worker.worker.teardown"), pytest.raises(KeyError, match="first"):
        run_every([step("a"), step("b", KeyError("first")), None, step("c", OSError("second")), step("d")])
    assert ran == ["a", "b", "c", "d"]
    assert "OSError('second')" in caplog.text  # the later error is logged, not lost


def test_steps_from_a_generator_run_once_each_and_nothing_is_raised() -> None:
    ran: list[int] = []
    run_every((lambda i=i: ran.append(i)) for i in range(3))
    assert ran == [0, 1, 2]
