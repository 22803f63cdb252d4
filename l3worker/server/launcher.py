"""`l3worker serve`'s processes: this one (API server 0, which launches the rest), the engine core,
and with `--api-server-count N` N-1 more API servers on the same listening socket.

    l3worker serve ── API server 0 (uvicorn on the bound socket)
          ├── engine core (l3worker/engine_core.py: the worker, its step loop, its chip-children)
          └── API servers 1..N-1 (l3worker/server/api_server.py: the socket's descriptor inherited)

Every process it starts runs in a session of its own, so a Ctrl-C at the terminal reaches this
one alone, which stops the rest in order: the other API servers first (each aborts its requests
while the core still runs), then the engine core (which stops its chip-children), then the socket
directory goes. Each started process also exits by itself when this one disappears.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from l3worker.engine_core import CoreConfig
from l3worker.server.core_client import CoreClient
from l3worker.server.runner import ModelInfo, ServeOptions
from l3worker.socket_dir import make_socket_dir

log = logging.getLogger("l3worker.server")
STOP_GRACE_S = 30.0  # how long a started process may take to stop before it is killed


@dataclass
class ApiServerConfig:
    """What API server `index` (>= 1) needs: its socket, its engine connection and the model."""

    index: int
    fd: int  # the listening socket, inherited
    control: str
    outputs: str
    core_pid: int
    parent_pid: int
    model: dict  # ModelInfo
    options: dict  # ServeOptions

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ApiServerConfig":
        return cls(**json.loads(text))


def _endpoints(run_dir: str, api_server_count: int) -> tuple[str, list[str]]:
    return f"ipc://{run_dir}/core-control", [f"ipc://{run_dir}/api-{i}-outputs" for i in range(api_server_count)]


def _spawn(module: str, config_json: str, **popen) -> subprocess.Popen:
    """`python -m module`, its configuration on stdin (not argv, where any user could read an API key)."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, start_new_session=True, **popen)
    proc.stdin.write(config_json.encode())
    proc.stdin.close()
    return proc


@dataclass
class Launch:
    """The processes this API server started, and how to stop them."""

    run_dir: str
    core: subprocess.Popen | None = None
    api_servers: list[subprocess.Popen] = field(default_factory=list)

    def signal_api_servers(self) -> None:
        """Each aborts its own requests and closes its connections (as this one does)."""
        for proc in self.api_servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    async def shutdown(self, client: CoreClient) -> None:
        """The other API servers, then the engine core, then the socket directory."""
        loop = asyncio.get_running_loop()
        self.signal_api_servers()
        for proc in self.api_servers:
            await loop.run_in_executor(None, _wait_or_kill, proc)
        if self.core is not None and self.core.poll() is None:
            await client.send_shutdown()
            await loop.run_in_executor(None, _wait_or_kill, self.core)
        self.remove()

    def kill(self) -> None:
        """Start-up failed: nothing is serving yet."""
        for proc in [*self.api_servers, *([self.core] if self.core else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            _wait_or_kill(proc)
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _wait_or_kill(proc: subprocess.Popen) -> None:
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log.error("pid %d did not stop within %.0f s: killed", proc.pid, STOP_GRACE_S)
        proc.kill()
        proc.wait()


def launch_core(worker_kwargs: dict, api_server_count: int) -> tuple[Launch, CoreClient]:
    """Starts the engine core (it prepares the worker on its own) and returns API server 0's
    client, whose outputs socket is bound before the core starts."""
    launch = Launch(make_socket_dir("l3worker-serve-"))
    control, outputs = _endpoints(launch.run_dir, api_server_count)
    try:
        client = CoreClient(0, control, outputs[0], 0, on_shutdown=launch.shutdown)
        config = CoreConfig(worker_kwargs, control, outputs, os.getpid())
        launch.core = _spawn("l3worker.engine_core", config.to_json())
        client.core_pid = launch.core.pid
    except BaseException:
        launch.kill()
        raise
    return launch, client


def launch_api_servers(launch: Launch, count: int, sock: socket.socket, info: ModelInfo,
                       options: ServeOptions) -> None:
    """API servers 1..count-1 on `sock`, each with its own engine connection."""
    control, outputs = _endpoints(launch.run_dir, count)
    for index in range(1, count):
        config = ApiServerConfig(index, sock.fileno(), control, outputs[index], launch.core.pid, os.getpid(),
                                 asdict(info), asdict(options))
        launch.api_servers.append(_spawn("l3worker.server.api_server", config.to_json(), pass_fds=(sock.fileno(),)))
