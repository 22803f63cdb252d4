"""The head's stand-in for its data-parallel engines on other nodes (`python -m l3worker.distributed.dp_remote`,
started by the launching API server like an engine core, its RemoteConfig as JSON on stdin).

To the API servers, remote rank e looks like a local engine core: it binds the same ipc:// control
ROUTER a local core would (core-e) and pushes to the same outputs PULLs. Every control message is
relayed unchanged to that rank's link (l3worker/distributed/dp_link.py) and every reply and per-step
outputs message back, so routing, metrics scrapes and health work over all ranks alike.

A rank that registers with the wrong model, max_model_len or data-parallel size is refused by
name. A rank whose node dies, whose engine core exits or whose link goes silent is lost: every
API server hears ["lost", text] on that rank's control socket (it fails the rank's requests, stops
routing there and answers /health 503). Ranks that do not all register within the start-up
timeout end this process with an error naming them, which fails the server's start-up. It stops
on SIGTERM or when its parent goes away, telling every connected rank to stop.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

import msgpack
import zmq

from l3worker.serving.core_wire import identity, pack
from l3worker.distributed.dp_link import (CTL, GONE, OUT, PING, REFUSED, REGISTER, STOP, WELCOME, SILENCE_S,
                                     Registration, Silence)

log = logging.getLogger("l3worker.distributed.dp_remote")
POLL_MS = 200


@dataclass
class RemoteConfig:
    endpoint: str  # tcp://ADDR:P, bound here
    controls: dict  # rank (as str: JSON keys) -> the ipc control endpoint bound here for it
    outputs: list[str]  # each API server's outputs PULL endpoint
    parent_pid: int
    expected: dict  # Registration fields every rank must match (its rank aside)
    startup_timeout_s: float = 600.0
    silence_s: float = SILENCE_S  # a registered rank quiet this long is lost (until it registers again)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RemoteConfig":
        return cls(**json.loads(text))


class RemoteEngines:
    def __init__(self, config: RemoteConfig):
        self.config = config
        self.ranks = sorted(int(r) for r in config.controls)
        self.ctx = zmq.Context()
        self.link = self.ctx.socket(zmq.ROUTER)
        self.link.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that went away raises: it is lost
        self.link.setsockopt(zmq.LINGER, 0)
        self.link.setsockopt(zmq.SNDHWM, 0)
        self.link.setsockopt(zmq.RCVHWM, 0)
        try:
            self.link.bind(config.endpoint)
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)
            raise
        self.monitor = self.link.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.controls: dict[int, zmq.Socket] = {}
        for rank in self.ranks:
            control = self.controls[rank] = self.ctx.socket(zmq.ROUTER)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(config.controls[str(rank)])
        self.pushes = []
        for endpoint in config.outputs:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(endpoint)
            self.pushes.append(push)
        self.peer: dict[int, bytes] = {}  # rank -> its link's identity
        self.rank_of: dict[bytes, int] = {}
        self.silence: dict[int, Silence] = {}
        self.pending: dict[int, list[list[bytes]]] = {r: [] for r in self.ranks}  # before the rank registers
        self.lost: set[int] = set()
        self.stopping = False
        self.expected = Registration(rank=-1, **config.expected)

    def run(self) -> int:
        """Relays until stopped or orphaned; 1 if the ranks did not all register in time."""
        parent = os.pidfd_open(self.config.parent_pid)
        deadline = time.monotonic() + self.config.startup_timeout_s
        poller = zmq.Poller()
        for sock in (self.link, self.monitor, *self.controls.values()):
            poller.register(sock, zmq.POLLIN)
        poller.register(parent, zmq.POLLIN)
        try:
            while not self.stopping:
                ready = dict(poller.poll(POLL_MS))
                if parent in ready:
                    log.warning("the API server that started the remote engines' relay is gone: stopping")
                    return 0
                self._take_link()
                for rank, control in self.controls.items():
                    while control.poll(0):
                        self._to_rank(rank, control.recv_multipart())
                if self.monitor in ready:
                    while self.monitor.poll(0):
                        self.monitor.recv_multipart()
                    self._ping_all(force=True)  # a closed connection: find whose, at once
                self._ping_all()
                missing = [r for r in self.ranks if r not in self.peer and r not in self.lost]
                if missing and time.monotonic() > deadline:
                    log.error("data-parallel rank(s) %s did not connect to %s within %.0f s (start-up timeout)",
                              ", ".join(map(str, missing)), self.config.endpoint, self.config.startup_timeout_s)
                    return 1
            return 0
        finally:
            os.close(parent)
            self.close()

    def close(self) -> None:
        for rank, ident in self.peer.items():
            if rank not in self.lost:
                self._send(rank, [ident, STOP])
        self.monitor.close(0)
        self.ctx.destroy(linger=1000)

    def _take_link(self) -> None:
        while self.link.poll(0):
            frames = self.link.recv_multipart()
            try:
                self._from_link(*frames)
            except Exception:  # anyone may reach this port: a malformed message must not stop the head
                log.exception("a malformed message on %s", self.config.endpoint)

    def _from_link(self, ident: bytes, kind: bytes, *rest: bytes) -> None:
        if kind == REGISTER:
            self._register(ident, Registration.from_wire(rest[0]))
            return
        rank = self.rank_of.get(ident)
        if rank is None or rank in self.lost:
            return
        self.silence[rank].hear()
        if kind == CTL:
            self.controls[rank].send_multipart(rest)
        elif kind == OUT:
            self.pushes[int(rest[0])].send(rest[1])
        elif kind == GONE:
            self._lose(rank, f"data-parallel rank {rank}'s engine core exited: {rest[0].decode()}")

    def _register(self, ident: bytes, reg: Registration) -> None:
        reason = reg.mismatch(self.expected)
        if reason is None and reg.rank not in self.ranks:
            reason = (f"data-parallel rank {reg.rank} is not one the head waits for (ranks "
                      f"{self.ranks[0]}..{self.ranks[-1]}; check --data-parallel-start-rank)")
        if reason is None and reg.rank in self.peer and reg.rank not in self.lost:
            reason = f"data-parallel rank {reg.rank} is already connected"
        if reason is not None:
            log.error("refused a remote engine: %s", reason)
            self._send(None, [ident, REFUSED, reason.encode()])
            return
        back = reg.rank in self.lost  # a restarted node: its API servers route to it again
        if back:
            self.lost.discard(reg.rank)
            self.rank_of.pop(self.peer[reg.rank], None)
        self.peer[reg.rank], self.rank_of[ident] = ident, reg.rank
        self.silence[reg.rank] = Silence(self.config.silence_s)
        log.info("data-parallel rank %d %s", reg.rank, "is back" if back else "connected")
        self._send(reg.rank, [ident, WELCOME, msgpack.packb({"api_server_count": len(self.pushes)})])
        if back:
            for index in range(len(self.pushes)):
                self.controls[reg.rank].send_multipart([identity(index), pack(["back"])])
        for frames in self.pending.pop(reg.rank, []):
            self._to_rank(reg.rank, frames)

    def _to_rank(self, rank: int, frames: list[bytes]) -> None:
        """An API server's control message [api-identity, payload] for `rank`."""
        if rank in self.lost:
            return  # its API servers were told
        if rank not in self.peer:
            self.pending[rank].append(frames)
            return
        self._send(rank, [self.peer[rank], CTL, *frames])

    def _ping_all(self, force: bool = False) -> None:
        for rank, ident in list(self.peer.items()):
            if rank in self.lost:
                continue
            silence = self.silence[rank]
            if silence.silent:
                self._lose(rank, f"data-parallel rank {rank}'s node went silent (nothing for "
                                 f"{silence.limit_s:g} s)")
            elif silence.ping_due() or force:
                self._send(rank, [ident, PING])

    def _send(self, rank: int | None, frames: list[bytes]) -> None:
        try:
            self.link.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection closed
            if rank is not None and rank not in self.lost:
                self._lose(rank, f"data-parallel rank {rank}'s node closed its connection ({exc.strerror})")

    def _lose(self, rank: int, text: str) -> None:
        log.error("%s: its requests fail and the server reports unhealthy", text)
        self.lost.add(rank)
        self._send(None, [self.peer[rank], STOP])  # a node still there (frozen, cut off) need not wait for the silence
        for index in range(len(self.pushes)):
            self.controls[rank].send_multipart([identity(index), pack(["lost", text])])


def main() -> int:
    config = RemoteConfig.from_json(sys.stdin.read())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launching API server's to handle
    try:
        relay = RemoteEngines(config)
    except zmq.ZMQError as exc:
        log.error("cannot listen for data-parallel engines on %s: %s", config.endpoint, exc)
        return 1

    def on_sigterm(signum, frame) -> None:
        relay.stopping = True

    signal.signal(signal.SIGTERM, on_sigterm)
    return relay.run()


if __name__ == "__main__":
    sys.exit(main())
