"""A headless data-parallel node (`l3worker serve MODEL --headless --data-parallel-size N
--data-parallel-size-local M --data-parallel-start-rank R --data-parallel-address HEAD
--data-parallel-rpc-port P`): engine cores of ranks R .. R+M-1 on this machine, served by the head.

Each rank registers over its own tcp:// link (l3worker/distributed/dp_link.py) before anything loads;
once the head welcomes it, its engine core starts exactly as a local one on the head does
(`python -m l3worker.serving.engine_core`, its share of this node's devices or cores), with this process in
the API servers' place: one control DEALER per API server of the head (identity api-i) and one
outputs PULL per API server, every message relayed unchanged over the link.

It exits when the head goes away (a closed connection, a silent link or the head's stop), on
SIGTERM or SIGINT, and when one of its engine cores exits (the head hears of it first); either
way it stops its engine cores (which stop their chip-children) and removes its socket directory.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace

import msgpack
import zmq

from l3worker.serving.core_wire import identity
from l3worker.serving.engine_core import CoreConfig
from l3worker.distributed.nodes import link_events, link_socket
from l3worker.distributed.dp_link import (CTL, GONE, OUT, PING, REFUSED, REGISTER, STOP, WELCOME, DpLayout,
                                     Registration, Silence)
from l3worker.serving.launcher import DataParallel, Launch, spawn
from l3worker.worker.socket_dir import make_socket_dir

log = logging.getLogger("l3worker.distributed.dp_headless")
POLL_MS = 200


class HeadGone(Exception):
    """The head closed the link, went silent or told this node to stop."""


@dataclass
class _Rank:
    """One remote engine: its link to the head and, once welcomed, its core's local sockets."""

    rank: int
    link: zmq.Socket
    monitor: zmq.Socket
    silence: Silence
    connected: bool = False
    api_server_count: int | None = None
    controls: list[zmq.Socket] | None = None  # DEALER api-i per API server of the head
    outputs: list[zmq.Socket] | None = None  # PULL per API server of the head
    core: subprocess.Popen | None = None


class HeadlessNode:
    def __init__(self, layout: DpLayout, worker_kwargs: dict, registration: Registration):
        self.layout = layout
        self.dp = DataParallel(layout.size, local_size=layout.local, start_rank=layout.start_rank)
        self.worker_kwargs = worker_kwargs
        self.registration = registration
        self.stopping = False

    def run(self) -> int:
        """0: the head went away or a stop was asked; 1: refused, or an engine core exited."""
        ctx = self.ctx = zmq.Context()
        launch = self.launch = Launch(make_socket_dir("l3worker-dp-"))
        endpoint = self.layout.endpoint()
        ranks: list[_Rank] = []
        try:
            for rank in self.layout.local_ranks:
                link, monitor = link_socket(ctx)
                link.connect(endpoint)
                reg = replace(self.registration, rank=rank)
                link.send_multipart([REGISTER, reg.to_wire()])
                ranks.append(_Rank(rank, link, monitor, Silence(self.layout.silence_s)))
            log.info("data-parallel ranks %d..%d: waiting for the head at %s", ranks[0].rank, ranks[-1].rank,
                     endpoint)
            return self._serve(ranks)
        except HeadGone as exc:
            log.info("the head went away (%s): stopping", exc)
            return 0
        finally:
            launch.kill()  # the engine cores (SIGTERM; each stops its chip-children), then the socket directory
            for r in ranks:
                r.monitor.close(0)
            ctx.destroy(linger=1000)  # a last word (gone) still reaches a head that is there

    def _serve(self, ranks: list[_Rank]) -> int:
        while not self.stopping:
            poller = zmq.Poller()
            for r in ranks:
                for sock in (r.link, *(r.controls or ()), *(r.outputs or ())):
                    poller.register(sock, zmq.POLLIN)
            poller.poll(POLL_MS)
            for r in ranks:
                refused = self._take_link(r)
                if refused:
                    print(f"l3worker serve --headless: the head refused data-parallel rank {r.rank}: {refused}",
                          file=sys.stderr, flush=True)
                    return 1
                self._relay_core(r)
            for r in ranks:
                if r.core is not None and r.core.poll() is not None:
                    text = f"pid {r.core.pid} exited with {r.core.returncode}"
                    log.error("data-parallel rank %d's engine core %s: stopping", r.rank, text)
                    r.link.send_multipart([GONE, text.encode()])
                    return 1
        return 0

    def _take_link(self, r: _Rank) -> str | None:
        """The head's messages for rank r; the refusal's reason if it refused the rank. Raises HeadGone."""
        for event in link_events(r.monitor):
            if event == zmq.EVENT_CONNECTED:
                r.connected = True
            elif event == zmq.EVENT_DISCONNECTED and r.connected:
                raise HeadGone("its connection closed")
        while r.link.poll(0):
            kind, *rest = r.link.recv_multipart()
            r.silence.hear()
            if kind == CTL:
                api, payload = rest
                r.controls[int(api.decode().removeprefix("api-"))].send(payload)
            elif kind == WELCOME:  # before the control messages that follow it are taken
                r.api_server_count = msgpack.unpackb(rest[0])["api_server_count"]
                self._start_core(r)
            elif kind == REFUSED:
                return rest[0].decode()
            elif kind == STOP:
                raise HeadGone("it asked this node to stop")
        if r.api_server_count is not None:  # welcomed: the head is there, and must stay audible
            if r.silence.silent:
                raise HeadGone("its link went silent")
            if r.silence.ping_due():
                r.link.send_multipart([PING])
        return None

    def _start_core(self, r: _Rank) -> None:
        """Rank r's engine core, its outputs PULLs bound first (nothing it sends is lost)."""
        ctx, launch, count = self.ctx, self.launch, r.api_server_count
        control = f"ipc://{launch.run_dir}/core-{r.rank}"
        outputs = [f"ipc://{launch.run_dir}/out-{r.rank}-{i}" for i in range(count)]
        r.outputs, r.controls = [], []
        for i in range(count):
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.RCVHWM, 0)
            pull.bind(outputs[i])
            r.outputs.append(pull)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity(i))
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(control)
            r.controls.append(dealer)
        config = CoreConfig(self.dp.engine_kwargs(self.worker_kwargs, r.rank), control, outputs, os.getpid(),
                            r.rank, self.dp.cpu_cores(self.worker_kwargs, r.rank))
        r.core = spawn("l3worker.serving.engine_core", config.to_json())
        launch.cores.append(r.core)
        log.info("data-parallel rank %d: engine core pid %d started", r.rank, r.core.pid)

    @staticmethod
    def _relay_core(r: _Rank) -> None:
        """The core's control replies and per-step outputs, unchanged, to the head."""
        for i, dealer in enumerate(r.controls or ()):
            while dealer.poll(0):
                r.link.send_multipart([CTL, identity(i), dealer.recv()])
        for i, pull in enumerate(r.outputs or ()):
            while pull.poll(0):
                r.link.send_multipart([OUT, str(i).encode(), pull.recv()])


def run_headless(layout: DpLayout, worker_kwargs: dict, registration: Registration) -> int:
    """The entry point: stops on SIGTERM or SIGINT."""
    node = HeadlessNode(layout, worker_kwargs, registration)

    def on_signal(signum, frame) -> None:
        node.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return node.run()
