"""How `l3worker serve`'s processes take SIGINT and SIGTERM, in a module without uvicorn or torch:
API server 0 installs it before it starts its early engine core (l3worker/serving/early_core.py),
so that a stop at any moment of the start-up is an orderly one."""
from __future__ import annotations

import signal
from typing import Callable


class SignalStop:
    """SIGINT and SIGTERM ask the server's orderly stop, also before uvicorn takes the signals over
    and after it hands them back (it re-raises what it caught): nothing raises KeyboardInterrupt
    through the engine's shutdown. Give `on_server` to serve()."""

    def __init__(self) -> None:
        self.requested = False
        self.server: object | None = None
        # Called on a stop before the server exists (start-up may wait long, e.g. for engines on
        # other nodes): it ends the wait.
        self.before_server: Callable[[], None] | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        if self.server is not None:
            self.server.should_exit = True
        elif self.before_server is not None:
            self.before_server()

    def on_server(self, server) -> None:
        self.server = server
        if self.requested:
            server.should_exit = True
