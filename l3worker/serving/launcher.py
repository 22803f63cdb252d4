"""`l3worker serve`'s processes: this one (API server 0, which launches the rest), the engine
core(s) (`--data-parallel-size D`), and with `--api-server-count N` N-1 more API servers on the same
listening socket.

    l3worker serve ── API server 0 (uvicorn on the bound socket)
          ├── engine cores 0..D-1 (l3worker/serving/engine_core.py: a worker, its step loop, its chip-children;
          │                        each its share of the devices, or on a cpu of the cores)
          ├── with engines on other nodes (--data-parallel-size-local M < D): the relay ranks M..D-1
          │                        connect to (l3worker/distributed/dp_remote.py)
          └── API servers 1..N-1 (l3worker/serving/api_server.py: the socket's descriptor inherited)

Every process it starts runs in a session of its own, so a Ctrl-C at the terminal reaches this
one alone, which stops the rest in order: the other API servers first (each aborts its requests
while the core still runs), then the engine cores (each stops its chip-children), then the socket
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

from chip_child.device import allowed_cores, device_type
from l3worker.serving.early_core import CORE_MODULE, EarlyCore
from l3worker.serving.engine_core import CoreConfig
from l3worker.serving.core_client import CoreClient
from l3worker.distributed.dp_remote import RemoteConfig
from l3worker.distributed.kv_event_feed import subscriber_endpoints
from l3worker.distributed.router import Router, RouterConfig
from l3worker.engine.kv_events import KVEventsConfig
from l3worker.serving.runner import ModelInfo, ServeOptions
from l3worker.worker.socket_dir import make_socket_dir

log = logging.getLogger("l3worker.serving")
STOP_GRACE_S = 30.0  # how long a started process may take to stop before it is killed


@dataclass
class ApiServerConfig:
    """What API server `index` (>= 1) needs: its socket, its engine connection and the model."""

    index: int
    fd: int  # the listening socket, inherited
    controls: list[str]
    outputs: str
    core_pids: list[int]
    parent_pid: int
    model: dict  # ModelInfo
    options: dict  # ServeOptions
    router: dict | None  # RouterConfig; None: one engine core

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ApiServerConfig":
        return cls(**json.loads(text))


def _endpoints(run_dir: str, dp_size: int, api_server_count: int) -> tuple[list[str], list[str]]:
    # Short names: a socket path has at most 107 bytes.
    return ([f"ipc://{run_dir}/core-{e}" for e in range(dp_size)],
            [f"ipc://{run_dir}/out-{i}" for i in range(api_server_count)])


@dataclass(frozen=True)
class DataParallel:
    """`--data-parallel-size` engine cores and how requests are routed to them; this machine runs
    ranks start_rank .. start_rank + local_size - 1 (default: all), the rest connect from other
    nodes (l3worker/distributed/dp_remote.py)."""

    size: int = 1
    routing: str = "cache_aware"
    local_size: int | None = None  # None: every rank here
    start_rank: int = 0

    @property
    def local(self) -> int:
        return self.size if self.local_size is None else self.local_size

    def engine_kwargs(self, worker_kwargs: dict, engine: int) -> dict:
        """Rank `engine`'s worker arguments: its consecutive share of this node's device ids (on a
        cpu, where the engines share one memory, also its share of --gpu-memory-utilization)."""
        if self.size > 1 and worker_kwargs.get("kv_events_config"):  # its events name it, on its own port
            worker_kwargs = {**worker_kwargs, "data_parallel_rank": engine}
        if self.local == 1:
            return worker_kwargs
        fraction = worker_kwargs.get("gpu_memory_utilization")
        if fraction is not None and device_type(worker_kwargs["device"]) == "cpu":
            worker_kwargs = {**worker_kwargs, "gpu_memory_utilization": fraction / self.local}
        ids = worker_kwargs.get("device_ids")
        if ids is None:  # the default: each engine its tensor-parallel ranks' worth, in order
            ids = list(range(self.local * (worker_kwargs.get("tensor_parallel_size") or 1)))
        if len(ids) % self.local:
            raise ValueError(f"--device-ids has {len(ids)} devices, which {self.local} local data-parallel "
                             "engines cannot share equally")
        per, i = len(ids) // self.local, engine - self.start_rank
        return {**worker_kwargs, "device_ids": ids[i * per:(i + 1) * per]}

    def cpu_cores(self, worker_kwargs: dict, engine: int) -> list[int] | None:
        """On a cpu, rank `engine`'s consecutive share of this process's cores (None: all, or not a cpu)."""
        if self.local == 1 or device_type(worker_kwargs["device"]) != "cpu":
            return None
        cores = allowed_cores()
        if len(cores) < self.local:
            return None  # fewer cores than engines: they share them all
        per, i = len(cores) // self.local, engine - self.start_rank
        return cores[i * per:(i + 1) * per]

    def router(self, page_size: int, num_pages: int, max_num_seqs: int,
               kv_events: KVEventsConfig | None = None) -> RouterConfig | None:
        """The margin: half a batch's rows; beyond it the request would wait for a row anyway.
        With KV events published over ZeroMQ by every rank on this node, a cache-aware router
        follows them."""
        if self.size == 1:
            return None
        follow = (kv_events is not None and kv_events.publisher == "zmq" and self.routing == "cache_aware"
                  and self.local == self.size)
        endpoints = subscriber_endpoints(kv_events.endpoint, self.size) if follow else ()
        return RouterConfig(self.size, page_size, num_pages, self.routing, max(1, max_num_seqs // 2),
                            events_endpoints=endpoints)


def spawn(module: str, config_json: str, **popen) -> subprocess.Popen:
    """`python -m module`, its configuration on stdin (not argv, where any user could read an API key)."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, start_new_session=True, **popen)
    proc.stdin.write(config_json.encode())
    proc.stdin.close()
    return proc


@dataclass
class Launch:
    """The processes this API server started, and how to stop them."""

    run_dir: str
    cores: list[subprocess.Popen] = field(default_factory=list)  # the local engine cores, by rank
    api_servers: list[subprocess.Popen] = field(default_factory=list)
    relay: subprocess.Popen | None = None  # the remote ranks' stand-in (data parallel across nodes)
    remote_ranks: int = 0

    @property
    def core_pids(self) -> list[int]:
        """The process behind each rank's control socket: the relay's for the remote ranks."""
        pids = [c.pid for c in self.cores]
        return pids + [self.relay.pid] * self.remote_ranks if self.relay else pids

    def _engines(self) -> list[subprocess.Popen]:
        """The local engine cores and the relay standing in for the remote ones."""
        return [*self.cores, *([self.relay] if self.relay else [])]

    def signal_api_servers(self) -> None:
        """Each aborts its own requests and closes its connections (as this one does)."""
        for proc in self.api_servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    async def shutdown(self, client: CoreClient) -> None:
        """The other API servers, then the engine cores, then the socket directory."""
        loop = asyncio.get_running_loop()
        self.signal_api_servers()
        for proc in self.api_servers:
            await loop.run_in_executor(None, _wait_or_kill, proc)
        for engine, core in enumerate(self.cores):
            if core.poll() is None:
                await client.send_shutdown(engine)
        for core in self.cores:
            await loop.run_in_executor(None, _wait_or_kill, core)
        if self.relay is not None:  # it tells the remote ranks to stop
            self.relay.send_signal(signal.SIGTERM)
            await loop.run_in_executor(None, _wait_or_kill, self.relay)
        self.remove()

    def stop_starting(self) -> None:
        """A stop before anything serves (called from the signal handler): the engine cores and the
        relay end their start-up at once, instead of finishing a model load first, and the wait for
        them raises."""
        for proc in self._engines():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Start-up failed: nothing is serving yet."""
        for proc in [*self.api_servers, *self._engines()]:
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


def launch_core(worker_kwargs: dict, api_server_count: int, dp: DataParallel = DataParallel(),
                router: RouterConfig | None = None, remote: dict | None = None,
                early: EarlyCore | None = None) -> tuple[Launch, CoreClient]:
    """Starts the local engine cores (each prepares its worker on its own) and, with `remote` (the
    RemoteConfig's endpoint, expected and startup_timeout_s) the relay the other ranks connect to;
    returns API server 0's client, whose outputs socket is bound before the cores start. `early`:
    engine core 0, already started, waiting for its config."""
    launch = Launch(make_socket_dir("l3worker-serve-"))
    controls, outputs = _endpoints(launch.run_dir, dp.size, api_server_count)
    try:
        client = CoreClient(0, controls, outputs[0], [], Router(router) if router else None,
                            on_shutdown=launch.shutdown)
        for engine in range(dp.local):
            config = CoreConfig(dp.engine_kwargs(worker_kwargs, engine), controls[engine], outputs, os.getpid(),
                                engine, dp.cpu_cores(worker_kwargs, engine))
            launch.cores.append(early.take(config.to_json()) if early is not None and engine == 0
                                else spawn(CORE_MODULE, config.to_json()))
        if dp.local < dp.size:
            config = RemoteConfig(controls={str(e): controls[e] for e in range(dp.local, dp.size)}, outputs=outputs,
                                  parent_pid=os.getpid(), **remote)
            launch.relay, launch.remote_ranks = spawn("l3worker.distributed.dp_remote", config.to_json()), dp.size - dp.local
        client.core_pids = launch.core_pids
    except BaseException:
        launch.kill()
        raise
    return launch, client


def launch_api_servers(launch: Launch, count: int, sock: socket.socket, info: ModelInfo,
                       options: ServeOptions, router: RouterConfig | None = None) -> None:
    """API servers 1..count-1 on `sock`, each with its own engine connections and router."""
    controls, outputs = _endpoints(launch.run_dir, len(launch.core_pids), count)
    for index in range(1, count):
        config = ApiServerConfig(index, sock.fileno(), controls, outputs[index], launch.core_pids,
                                 os.getpid(), asdict(info), asdict(options), asdict(router) if router else None)
        launch.api_servers.append(spawn("l3worker.serving.api_server", config.to_json(), pass_fds=(sock.fileno(),)))
