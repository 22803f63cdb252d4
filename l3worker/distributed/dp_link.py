"""Data-parallel engines on other nodes: the tcp:// link between a headless node's engine cores
and the head (vLLM's flags: `--data-parallel-size N --data-parallel-size-local M
--data-parallel-start-rank R --data-parallel-address ADDR --data-parallel-rpc-port P`).

The head (l3worker/distributed/dp_remote.py) binds one ZeroMQ ROUTER at tcp://ADDR:P; each remote
engine core's node (l3worker/distributed/dp_headless.py) connects one DEALER per engine rank. Frames,
node -> head (the ROUTER prepends the link's identity):
  [register, msgpack{rank, dp_size, model, max_model_len, vocab_size, fingerprint}]  first, once
  [ctl, api-identity, payload]   a control reply of the core (l3worker/serving/core_wire.py, unchanged)
  [out, api-index, payload]      an outputs message of the core (one per step, unchanged)
  [ping]                         every HEARTBEAT_S
  [gone, text]                   the engine core exited
head -> node:
  [welcome, msgpack{api_server_count}] | [refused, text]   the answer to register
  [ctl, api-identity, payload]   a control message of API server api-identity (add, abort, ...)
  [ping] | [stop]
Either side that hears nothing for --data-parallel-silence-timeout (pings included) takes the
other for gone; a closed connection is seen at once. A rank that was lost may register again (a
restarted node): the head takes it back, and its API servers route to it again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack

from chip_child.models.fingerprint import mismatch

REGISTER, WELCOME, REFUSED = b"register", b"welcome", b"refused"
CTL, OUT, PING, GONE, STOP = b"ctl", b"out", b"ping", b"gone", b"stop"
HEARTBEAT_S = 1.0  # a ping each way every second, busy or idle
SILENCE_S = 3.0  # nothing from the other side for this long: it is gone (the default of the flag)


@dataclass(frozen=True)
class DpLayout:
    """Which data-parallel ranks run where: this node runs ranks start_rank .. start_rank + local_size - 1
    of size; the head (start_rank 0) waits for the others at address:rpc_port."""

    size: int = 1
    local_size: int | None = None  # None: every rank on the head, or the rest after start_rank headless
    start_rank: int = 0
    address: str | None = None
    rpc_port: int | None = None
    headless: bool = False
    silence_s: float = SILENCE_S  # --data-parallel-silence-timeout: either side quiet this long is gone

    @property
    def local(self) -> int:
        if self.local_size is not None:
            return self.local_size
        return self.size - self.start_rank

    @property
    def remote(self) -> bool:
        """Some ranks run elsewhere: the tcp link is needed."""
        return self.headless or self.local < self.size

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.local)

    def refusal(self) -> str | None:
        """Why these flags make no layout, naming the flag; None when they do."""
        n = self.size
        if n < 1:
            return f"--data-parallel-size must be >= 1, got {n}"
        if not 0 <= self.start_rank < n:
            return f"--data-parallel-start-rank must be in [0, --data-parallel-size={n}), got {self.start_rank}"
        if not self.headless and self.start_rank:
            return "--data-parallel-start-rank belongs to --headless nodes: the head runs ranks 0 .. M-1"
        if self.local < 1:
            return f"--data-parallel-size-local must be >= 1, got {self.local}"
        if self.start_rank + self.local > n:
            return (f"--data-parallel-start-rank {self.start_rank} + --data-parallel-size-local {self.local} "
                    f"exceeds --data-parallel-size {n}")
        if self.headless and self.start_rank < 1:
            return "--headless data-parallel engines start at rank >= 1 (--data-parallel-start-rank): rank 0 is the head's"
        if self.remote and not self.address:
            return ("--data-parallel-address is needed with engines on other nodes: the head's address "
                    "(--headless) or the one it listens on")
        if self.remote and not (isinstance(self.rpc_port, int) and 0 < self.rpc_port <= 65535):
            return f"--data-parallel-rpc-port must be a port in 1..65535 with engines on other nodes, got {self.rpc_port}"
        return None

    def endpoint(self) -> str:
        import socket

        return f"tcp://{socket.gethostbyname(self.address)}:{self.rpc_port}"


@dataclass(frozen=True)
class Registration:
    """What a remote engine core tells the head before it loads anything."""

    rank: int
    dp_size: int
    model: str  # the model's name (the checkpoint directory's, or the built-in one's)
    max_model_len: int
    vocab_size: int
    # chip_child.models.fingerprint of its checkpoint: same-shaped other weights are refused too
    fingerprint: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> bytes:
        return msgpack.packb([self.rank, self.dp_size, self.model, self.max_model_len, self.vocab_size,
                              self.fingerprint])

    @classmethod
    def from_wire(cls, data: bytes) -> "Registration":
        return cls(*msgpack.unpackb(data))

    def mismatch(self, head: "Registration") -> str | None:
        """Why the head must refuse this engine (naming what differs), or None."""
        for name, flag in (("dp_size", "--data-parallel-size"), ("model", "the model"),
                           ("max_model_len", "--max-model-len"), ("vocab_size", "the model's vocab_size")):
            mine, theirs = getattr(self, name), getattr(head, name)
            if mine != theirs:
                return f"{flag} differs: the head has {theirs!r}, data-parallel rank {self.rank} has {mine!r}"
        differs = mismatch(self.fingerprint, head.fingerprint)
        if differs is not None:
            return f"data-parallel rank {self.rank}'s checkpoint is not the head's model: {differs}"
        return None


class Silence:
    """When the other side was last heard from, and when ours is due a ping."""

    def __init__(self, limit_s: float = SILENCE_S) -> None:
        self.limit_s = limit_s
        self.heard = self.pinged = time.monotonic()

    def hear(self) -> None:
        self.heard = time.monotonic()

    def ping_due(self) -> bool:
        now = time.monotonic()
        if now - self.pinged >= HEARTBEAT_S:
            self.pinged = now
            return True
        return False

    @property
    def silent(self) -> bool:
        return time.monotonic() - self.heard > self.limit_s
