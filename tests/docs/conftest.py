"""What the documentation tests share: `l3worker serve` processes started from the docs' own serve
commands (on free ports), at most two alive at a time, each stopped with SIGTERM and required to
exit 0; and a scratch directory per block that links to the repository's examples/ and scripts/."""
from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from doc_blocks import ROOT, serve_argv
from server_helpers import READY

MAX_ALIVE = 3  # servers kept for later blocks; the least recently used beyond this are stopped
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0


class DocServer:
    """One `l3worker serve` started from a documentation command."""

    def __init__(self, command: str, tmpdir: Path):
        self.command = command
        env = dict(os.environ, TMPDIR=str(tmpdir))
        self.proc = subprocess.Popen([sys.executable, "-m", "l3worker", "serve", *serve_argv(command), "--port", "0"],
                                     cwd=tmpdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: collections.deque[str] = collections.deque(maxlen=60)
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.log.append), daemon=True).start()
        self.url = self._ready()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def _ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"`{self.command}` not ready in {START_TIMEOUT_S:.0f}s: {self.tail()}") from None
            if line is None:
                raise AssertionError(f"`{self.command}` exited with {self.proc.wait()} before it was ready: "
                                     f"{self.tail()}")
            if m := READY.match(line):
                return m[1]

    def tail(self) -> str:
        return "\n".join(line for line in self.log if line)

    def stop(self) -> int | None:
        """SIGTERM, as Ctrl-C would; its exit status (None: it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and what it started
            self.proc.wait(30)


class DocServers:
    def __init__(self, tmp: pytest.TempPathFactory):
        self.tmp = tmp
        self.alive: collections.OrderedDict[str, DocServer] = collections.OrderedDict()
        self.failures: list[str] = []

    def url(self, command: str) -> str:
        """The URL of a server started from `command` (started now unless one is alive)."""
        if command in self.alive:
            self.alive.move_to_end(command)
            server = self.alive[command]
            if server.proc.poll() is not None:
                del self.alive[command]
                raise AssertionError(f"`{command}` exited with {server.proc.returncode}: {server.tail()}")
            return server.url
        while len(self.alive) >= MAX_ALIVE:
            self._stop(*self.alive.popitem(last=False))
        self.alive[command] = DocServer(command, self.tmp.mktemp("doc-server"))
        return self.alive[command].url

    def _stop(self, command: str, server: DocServer) -> None:
        status = server.stop()
        if status != 0:
            self.failures.append(f"`{command}` exited with {status} on SIGTERM (0 expected): {server.tail()}")

    def close(self) -> None:
        while self.alive:
            self._stop(*self.alive.popitem(last=False))


@pytest.fixture(scope="session")
def doc_servers(tmp_path_factory: pytest.TempPathFactory):
    servers = DocServers(tmp_path_factory)
    yield servers
    servers.close()
    assert not servers.failures, "\n".join(servers.failures)


@pytest.fixture(scope="session")
def l3worker_on_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PATH whose `l3worker` runs this interpreter's package (`python -m l3worker`), first."""
    bin_dir = tmp_path_factory.mktemp("bin")
    script = bin_dir / "l3worker"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m l3worker "$@"\n')
    script.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A working directory for one block: what it writes stays here; examples/ and scripts/ link
    to the repository's."""
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path
