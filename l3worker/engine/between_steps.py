"""A call another thread asks the engine's loop thread to run between two steps (sleep, new
weights, pause: l3worker/worker/rollout.py), and waits for."""
from __future__ import annotations

import threading
from typing import Callable


class BetweenSteps:
    """A call the loop thread runs between two steps for another thread, which waits for it."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self._done = threading.Event()
        self._value: object = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self.fn()
        except BaseException as exc:  # the caller's to raise
            self._error = exc
        finally:
            self._done.set()

    def result(self, gone: Callable[[], BaseException | None]) -> object:
        """Waits for the call; raises what `gone` returns if the loop stops first."""
        while not self._done.wait(0.1):
            if (why := gone()) is not None:
                raise why
        if self._error is not None:
            raise self._error
        return self._value
