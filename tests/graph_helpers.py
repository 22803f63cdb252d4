"""A stand-in for a device's graph capture, so that the decode-graph path runs on the cpu."""
from __future__ import annotations

from typing import Callable


class StandInCapturer:
    """Plays a device graph: `capture` runs the callable once (as the device's capture run does)
    and returns a replay that runs the same callable, with the host arguments it was captured
    with. A host value that should have followed the step would give wrong tokens."""

    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        self.captured += 1

        def replay() -> None:
            self.replays += 1
            fn()

        return replay
