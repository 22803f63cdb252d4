"""A follower node (`l3worker serve MODEL --headless --nnodes N --node-rank R ...`): the chip-children
of this node's tensor-parallel ranks, driven by the head's engine over tcp:// ZeroMQ.

It connects to the head (l3worker/distributed/nodes.py), then, per generation the head starts, makes its own
shared ring, starts one chip-child per local device exactly as the head does for its own
(`python -m chip_child`, joining the head's torch.distributed group), and forwards every step
command to them, first writing the prompt ids the command staged into its ring slot. Its
children never publish tokens (rank 0, on the head, does), so nothing else goes back but their
failures. It exits when the head goes away (the link's heartbeats or a closed connection), on
SIGTERM or SIGINT, and leaves no process, socket file or shared segment behind.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, replace
from typing import Sequence

import msgpack
import numpy as np
import zmq

from chip_child.config import RuntimeConfig
from chip_child.device import default_cpu_threads, device_type
from chip_child.models.fingerprint import checkpoint_fingerprint, mismatch
from chip_child.models.tiny_model import ensure_tiny_model
from l3worker.worker.child_process import LIVENESS_POLL_MS, ChildProcess, child_spec, wait_all_ready
from l3worker.errors import ChildFailure, StoppingError
from l3worker.hub import resolve_model
from l3worker.distributed.nodes import (DIED, ERROR, LAUNCH, READY, STEP, STOP, STOPPED, NodeLayout, link_events,
                            link_socket)
from l3worker.worker.shared_buffers import StepBuffers
from l3worker.worker.socket_dir import make_socket_dir

log = logging.getLogger("l3worker.distributed.follower")


class HeadGone(Exception):
    """The head's connection closed, or its heartbeats stopped."""


@dataclass
class FollowerOptions:
    layout: NodeLayout
    model_dir: str | None = None  # this node's copy of the head's model; None: the built-in one
    revision: str | None = None
    download_dir: str | None = None
    device: str = "auto"
    device_ids: Sequence[int] | None = None  # this node's devices; None: 0 .. ranks per node - 1


class Follower:
    def __init__(self, options: FollowerOptions):
        layout = options.layout
        layout.validate()
        if layout.nnodes < 2 or layout.node_rank < 1:
            raise ValueError(f"a follower is node 1 .. nnodes - 1 of nnodes >= 2, got node_rank={layout.node_rank} "
                             f"of nnodes={layout.nnodes}; node 0 is the head")
        self.layout = layout
        self.device = options.device
        self.device_ids = layout.local_devices(tuple(options.device_ids) if options.device_ids is not None else None)
        self.model_dir = str(ensure_tiny_model()) if options.model_dir is None else \
            resolve_model(options.model_dir, options.revision, options.download_dir)
        self.stopping = threading.Event()  # SIGTERM / SIGINT, or stop() from another thread
        self._fingerprint: dict[str, str] | None = None  # this node's checkpoint's, checked against the head's
        self._children: list[ChildProcess] = []
        self._buffers: StepBuffers | None = None
        self._generation = -1
        self._reported = False  # this generation's failure went to the head already
        self._step_timeout_s: float | None = None
        self._connected = False  # to a head, once at least
        self._poller: zmq.Poller | None = None
        self._polled: list[ChildProcess] | None = None  # the children _poller watches

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> int:
        """Serves the head until it goes away or a stop is asked. 0: the head went away or a stop
        was asked after it had connected; 1: stopped before any head connected."""
        ctx = zmq.Context()
        sock, self._monitor = link_socket(ctx)
        self._socket_dir = make_socket_dir("l3worker-")
        self._ctx, self._sock = ctx, sock
        endpoint = self.layout.command_endpoint(self.layout.node_rank)
        sock.connect(endpoint)
        log.info("follower node %d: waiting for the head at %s", self.layout.node_rank, endpoint)
        try:
            while not self.stopping.is_set():
                self._check_head()
                self._serve_once()
            return 0 if self._connected else 1
        except HeadGone:
            log.info("follower node %d: the head went away", self.layout.node_rank)
            return 0
        except StoppingError:  # a stop asked during a start-up
            return 0
        finally:
            self._stop_children(2.0)
            self._monitor.close(0)
            ctx.destroy(linger=0)
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _check_head(self) -> None:
        """Raises HeadGone once the head that connected went away (a head not up yet is waited for)."""
        for event in link_events(self._monitor):
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                raise HeadGone()

    def _serve_once(self) -> None:
        """One poll: the head's messages, then the children's replies, or their liveness."""
        if self._polled is not self._children:  # a generation started or stopped since the last poll
            self._poller = zmq.Poller()
            for sock in (self._sock, *(c.sock for c in self._children)):
                self._poller.register(sock, zmq.POLLIN)
            self._polled = self._children
        events = dict(self._poller.poll(LIVENESS_POLL_MS))
        if self._sock in events:
            self._take_commands()
        try:
            for child in self._children:
                if child.sock in events:
                    child.drain()
                elif not events:
                    child.check_alive("its next command")
        except ChildFailure as exc:
            self._report(DIED if not all(c.alive for c in self._children) else ERROR, str(exc))

    def _take_commands(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            if kind == STEP:
                self._step(frames)
            elif kind == LAUNCH:
                self._launch(int(frames[1]), json.loads(frames[2]))
            elif kind == STOP:
                self._stop_children(float(frames[2]))
                self._sock.send_multipart([STOPPED, frames[1]])

    def _step(self, frames: list[bytes]) -> None:
        if not self._children or self._reported:
            return  # nothing to run it on: the head hears why from the report
        if len(frames) == 4:  # the prompt ids it staged: where this node's children read them
            ids = np.frombuffer(frames[3], np.int32)
            self._buffers.staging[int(frames[2])].numpy()[:len(ids)] = ids
        try:
            for child in self._children:
                child.send(frames[1], self._step_timeout_s, self.stopping)
        except ChildFailure as exc:
            self._report(DIED, str(exc))
        except StoppingError:
            pass

    def _launch(self, generation: int, launch: dict) -> None:
        """Starts this node's children for `generation` and reports them ready (or why not)."""
        self._stop_children(2.0)
        self._generation, self._reported = generation, False
        self._step_timeout_s = launch["step_timeout_s"]
        if launch["node_rank"] != self.layout.node_rank:
            self._report(ERROR, f"this follower is node {self.layout.node_rank}, but the head sent node "
                                f"{launch['node_rank']}'s start (check --node-rank and --master-port)")
            return
        if self._fingerprint is None:
            self._fingerprint = checkpoint_fingerprint(self.model_dir)
        if (differs := mismatch(self._fingerprint, launch["model_fingerprint"])) is not None:
            self._report(ERROR, f"this node's checkpoint ({self.model_dir}) is not the head's model: {differs}")
            return
        shape = (launch["slots"], launch["max_batch_size"], launch["prefill_capacity"])
        if self._buffers is None or (self._buffers.slots, *self._buffers.sampled.shape[1:],
                                     self._buffers.staging.shape[1]) != shape:
            self._buffers = StepBuffers.create(*shape)
        runtime = RuntimeConfig(**launch["runtime"])
        threads = runtime.num_threads
        if threads is None and device_type(self.device) == "cpu":
            threads = default_cpu_threads(len(self.device_ids))
        first = self.layout.first_rank(self.layout.node_rank)
        try:
            for i, device_id in enumerate(self.device_ids):
                rc = replace(runtime, model_dir=self.model_dir, device=self.device, device_id=device_id,
                             tp_rank=first + i, num_threads=threads)
                spec = child_spec(first + i, rc, self._buffers, self._socket_dir, fault=launch["fault"],
                                  overlap_steps=launch["overlap_steps"], generation=generation)
                self._children.append(ChildProcess(self._ctx, spec, self._buffers))
            wait_all_ready(self._children, launch["startup_timeout_s"], self.stopping, self._check_head)
        except (StoppingError, HeadGone):
            raise
        except Exception as exc:  # what the head must hear: its own rank 0 waits for these ranks
            self._report(ERROR, f"start-up failed: {type(exc).__name__}: {exc}")
            return
        info = dict(self._children[0].info, pid=os.getpid(), child_pids=[c.pid for c in self._children])
        self._sock.send_multipart([READY, str(generation).encode(), msgpack.packb(info)])

    def _report(self, kind: bytes, text: str) -> None:
        """Tells the head this generation failed (once: later failures follow from the first)."""
        if not self._reported:
            self._reported = True
            self._sock.send_multipart([kind, str(self._generation).encode(), text.encode()])

    def _stop_children(self, grace_s: float) -> None:
        children, self._children = self._children, []
        for child in children:
            child.stop(grace_s)


def follower_command(model_dir: str | None, layout: NodeLayout, *flags: str) -> list[str]:
    """The command line of follower node `layout.node_rank` (what a launcher runs on that node)."""
    return [sys.executable, "-m", "l3worker", "serve", *([str(model_dir)] if model_dir is not None else []),
            "--headless", "--tensor-parallel-size", str(layout.tensor_parallel_size), "--nnodes", str(layout.nnodes),
            "--node-rank", str(layout.node_rank), "--master-addr", layout.master_addr,
            "--master-port", str(layout.master_port), *flags]


def run_follower(options: FollowerOptions) -> int:
    """The headless entry point: stops on SIGTERM or SIGINT."""
    follower = Follower(options)

    def on_signal(signum, frame) -> None:
        follower.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return follower.run()
