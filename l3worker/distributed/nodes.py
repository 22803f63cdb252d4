"""Tensor parallel across nodes: which ranks live where, and the head's handle on a follower node.

vLLM's flags: `tensor_parallel_size` ranks over `nnodes` nodes, `tensor_parallel_size // nnodes`
on each; node r holds ranks r * local .. (r + 1) * local - 1, rank 0 (the one that publishes
tokens) on the head, node 0. Every rank joins one torch.distributed group by TCP rendezvous at
`master_addr:master_port` (rank 0's child hosts the store). The head's engine reaches follower
node r over ZeroMQ at tcp://master_addr:(master_port + r): one DEALER pair per follower, which
the follower connects to (l3worker/distributed/follower.py) and which both sides watch with ZeroMQ's own
heartbeats, so a dead peer or a lost connection is noticed in seconds whether or not a step runs.

A RemoteNode stands in the engine's list of children for all the ranks of one follower node: it
takes the same step command as a local child, plus, on a step that stages prompt ids, those ids
(no shared memory crosses hosts); the follower writes them where its own children read them.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from chip_child import protocol
from chip_child.models.fingerprint import checkpoint_fingerprint
from l3worker.worker.child_process import ChildProcess
from l3worker.errors import ChildDiedError, ChildError, ChildFailure
from l3worker.worker.shared_buffers import StepBuffers

HEARTBEAT_IVL_MS = 1000  # a ping every second on an otherwise idle connection
HEARTBEAT_TIMEOUT_MS = 3000  # no traffic for this long: the connection is dropped as dead
STOP_EXTRA_S = 2.0  # a follower stops its children within the grace it is given, plus this
# How long a restart waits for a follower that is not connected (the first start waits as long as
# the children's start-up may take: followers may start after the head). Each restart of the
# budget waits this long, so a follower that stays away fails the engine within
# max_restarts * REJOIN_WAIT_S; /health says 503 from the moment it went. A node restarted by its
# supervisor imports torch before it connects: over 10 s on a loaded 2-core host.
REJOIN_WAIT_S = 30.0

# Frame 0 of every message between the head and a follower; frame 1 the generation (children
# start count) as ascii, so replies of children the head already replaced are told apart.
LAUNCH, STEP, STOP = b"launch", b"step", b"stop"  # head -> follower
READY, ERROR, DIED, STOPPED = b"ready", b"error", b"died", b"stopped"  # follower -> head
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class NodeLayout:
    tensor_parallel_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # the torch.distributed store; followers' commands on the ports above it

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                             f"nnodes={self.nnodes}: every node holds as many ranks")
        if self.nnodes > 1:
            if not isinstance(self.master_port, int) or not 0 < self.master_port <= 65535 - self.nnodes:
                raise ValueError(f"nnodes={self.nnodes} needs master_port, a port with {self.nnodes - 1} "
                                 f"free port(s) above it, got {self.master_port!r}")
            if not self.master_addr:
                raise ValueError("nnodes > 1 needs master_addr, the head's address the followers reach")

    @classmethod
    def of(cls, tensor_parallel_size: int | None, device_ids: tuple[int, ...] | None, nnodes: int, node_rank: int,
           master_addr: str, master_port: int | None) -> "NodeLayout":
        """The layout the flags give, checked; tensor_parallel_size None: one rank per device id on
        every node."""
        tp = tensor_parallel_size or (len(device_ids) if device_ids is not None else 1) * nnodes
        layout = cls(tp, nnodes, node_rank, master_addr, master_port)
        layout.validate()
        return layout

    def local_devices(self, device_ids: tuple[int, ...] | None) -> tuple[int, ...]:
        """This node's device ids: as given, checked to count local_size; None: 0 .. local_size - 1."""
        if device_ids is None:
            return tuple(range(self.local_size))
        if len(device_ids) != self.local_size:
            raise ValueError(f"device_ids {device_ids} must name tensor_parallel_size // nnodes = "
                             f"{self.local_size} device(s) on this node")
        return device_ids

    @property
    def local_size(self) -> int:
        """Ranks on each node."""
        return self.tensor_parallel_size // self.nnodes

    def first_rank(self, node: int) -> int:
        return node * self.local_size

    @property
    def dist_init(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def command_endpoint(self, node: int) -> str:
        """Where follower `node` takes its commands (the head binds, the follower connects)."""
        return f"tcp://{socket.gethostbyname(self.master_addr)}:{self.master_port + node}"


def free_master_port(nnodes: int, host: str = "127.0.0.1") -> int:
    """A port p such that p .. p + nnodes - 1 were free just now: the rendezvous, then the
    followers' command ports (another process may still take one before the head binds)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        held: list[socket.socket] = []
        try:
            for port in range(base, base + nnodes):
                held.append(socket.socket())
                held[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"found no {nnodes} consecutive free ports on {host}")


def link_socket(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER for one head-follower link, with heartbeats, and the monitor that reports its
    connections coming and going."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock, sock.get_monitor_socket(MONITORED)


def link_events(monitor: zmq.Socket) -> list[int]:
    """The connection events reported since the last call."""
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    return events


class RemoteNode(ChildProcess):
    """The head's handle on every rank of one follower node, in the engine's list of children.
    Made once per worker (its socket outlives restarts); start() begins each generation."""

    def __init__(self, ctx: zmq.Context, layout: NodeLayout, node: int, buffers: StepBuffers):
        self.node = node
        self.rank = layout.first_rank(node)
        self.endpoint = layout.command_endpoint(node)
        self._staging = buffers.staging.numpy()
        self.sock, self._monitor = link_socket(ctx)
        try:
            self.sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            self._monitor.close(0)
            raise OSError(f"cannot listen for follower node {node} on {self.endpoint}: {exc}") from None
        self.info: dict = {}
        self.generation = -1
        self.running = False  # a generation was started and not stopped
        self.lost = False  # its connection dropped while it ran
        self._links = 0  # connections up now
        self._fingerprint: dict[str, str] | None = None  # the head's model's, sent with each start

    @property
    def pid(self) -> int:
        return self.info.get("pid", 0)  # the follower's process, on its own host

    def _track(self) -> None:
        for event in link_events(self._monitor):
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._links += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self._links = max(0, self._links - 1)
                self.lost = self.lost or self.running

    def start(self, generation: int, launch: dict, timeout_s: float | None,
              cancel: threading.Event | None) -> None:
        """Asks the follower to start its children for `generation`, waiting for it to be connected
        (a follower that went away may come back for a restart: see REJOIN_WAIT_S)."""
        self._track()
        if self.generation >= 0 and timeout_s is not None:
            timeout_s = min(timeout_s, REJOIN_WAIT_S)
        elif self.generation >= 0:
            timeout_s = REJOIN_WAIT_S
        self.generation, self.running, self.lost, self.info = generation, True, False, {}
        if self._fingerprint is None:  # the follower refuses to start a model other than the head's
            self._fingerprint = checkpoint_fingerprint(launch["runtime"]["model_dir"])
        launch = dict(launch, model_fingerprint=self._fingerprint)
        self._send([LAUNCH, str(generation).encode(), json.dumps(launch).encode()], timeout_s, cancel,
                   f"follower node {self.node} to connect at {self.endpoint}")

    def send(self, payload: bytes, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        """A step command; with the prompt ids it staged, when it stages any."""
        frames = [STEP, payload]
        if payload[1:2] == bytes([protocol.OP_PREFILL]):  # [1, step, ...]: msgpack's fixarray, then op
            msg = msgpack.unpackb(payload)
            chunks = np.frombuffer(msg[5], np.int32).reshape(-1, 5)
            end = int((chunks[:, 3] + chunks[:, 2]).max()) if len(chunks) else 0
            if end:
                slot = msg[1] % self._staging.shape[0]
                frames += [str(slot).encode(), self._staging[slot, :end].tobytes()]
        self._send(frames, timeout_s, cancel, "a command to be taken")

    def _send(self, frames: list[bytes], timeout_s: float | None, cancel: threading.Event | None, what: str) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self._wait_for(zmq.POLLOUT, deadline, what, cancel, lambda: f"was not reachable for {what} "
                                                                             f"within {timeout_s:g}s")

    def check_alive(self, what: str) -> None:
        self._track()
        if self.lost:
            raise ChildDiedError(f"follower node {self.node} (ranks from {self.rank}, {self.endpoint}) lost its "
                                 f"connection while the head waited for {what}")

    @property
    def alive(self) -> bool:
        self._track()
        return self.running and not self.lost

    def _read(self, flags: int = 0) -> list[bytes]:
        return self.sock.recv_multipart(flags)

    def _unpack(self, frames: list[bytes], what: str) -> dict | None:
        """A follower's reply of this generation: READY and STOPPED as maps, ERROR and DIED raise;
        replies of an earlier generation are dropped."""
        kind, generation = frames[0], int(frames[1])
        if generation != self.generation:
            return None
        if kind == ERROR:
            raise ChildError(f"follower node {self.node}: {frames[2].decode()}")
        if kind == DIED:  # a child of the follower's: the follower stops the others on stop()
            raise ChildDiedError(f"follower node {self.node}: {frames[2].decode()} while the head waited for {what}")
        if kind == READY:
            return msgpack.unpackb(frames[2])
        return {"stopped": True}

    def stop(self, grace_s: float = 5.0) -> None:
        """Asks the follower to stop this generation's children and waits for it to say so (a
        follower that went away has nothing to stop). The link stays for the next start()."""
        self._track()
        if self.running and not self.lost and self._links:
            try:
                self._send([STOP, str(self.generation).encode(), str(grace_s).encode()], 1.0, None, "a stop")
                while True:
                    try:
                        if "stopped" in self.recv(grace_s + STOP_EXTRA_S, "its children to stop"):
                            break
                    except ChildError:
                        continue  # the children's last words: they are being stopped anyway
            except ChildFailure:
                pass
        self.running = False

    def close(self) -> None:
        self.sock.close(0)
        self._monitor.close(0)
