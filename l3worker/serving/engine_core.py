"""The engine-core process of `l3worker serve`: the engine's step loop, away from HTTP.

`python -m l3worker.serving.engine_core` (its CoreConfig as JSON on stdin), started by the launching API
server (l3worker/serving/launcher.py), or on another node by a headless data-parallel node
(l3worker/distributed/dp_headless.py), which relays its sockets to the head unchanged. It makes a DistributedWorker from the same arguments, prepares it
(starting the chip-children) and serves its API servers over the wire of l3worker/serving/core_wire.py:
the main thread answers the control socket (adds, aborts, metrics scrapes, health), the loop thread
drives Engine.step (run_step_loop, as AsyncEngine does in-process) and sends one message per step
to each API server with requests that advanced. Its own interpreter lock serves the step loop
alone, so HTTP work never delays a step. Rollout controls (sleep, weight updates, pause; they wait
for the loop thread, a weight update for a whole checkpoint's load) run on threads of their own;
the main thread sends their replies, woken by a pipe, so its socket never waits on them.

It stops when told to (a shutdown message, SIGTERM), and at once when the process that started it
goes away (a pidfd on it is polled with the control socket): nobody could reach it any more.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":  # first of all: the early chip-child's imports overlap this module's own
    from l3worker.serving.early_core import start_early_child

    EARLY_CHILD = start_early_child(sys.argv)

import ctypes
import json
import logging
import os
import shutil
import signal
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import zmq

from chip_child.device import move_threads_off
from l3worker.serving.async_engine import run_step_loop
from l3worker.serving.controls import run_control
from l3worker.serving.core_wire import error_kind, identity, output_to_wire, pack, params_from_wire, unpack
from l3worker.engine.step_loop import EngineDeadError
from l3worker.lora import LoRARequest
from l3worker.errors import EngineBusyError
from l3worker.engine.metrics import families_to_wire
from l3worker.engine.stats import GenerateStats
from l3worker.params import RequestOutput
from l3worker.worker.distributed_worker import DistributedWorker
from l3worker.worker.early_child import EarlyChild

log = logging.getLogger("l3worker.serving.engine_core")
# A file to write every served step's record to (l3worker.engine.stats.StepRecord, as a JSON list)
# when the core stops: for benchmarks (scripts/bench_serve.py --step-trace), not for long runs, whose
# records it would keep in memory.
STEP_TRACE_ENV = "L3WORKER_STEP_TRACE"
POLL_MS = 100  # how often the main thread looks at the engine's health and the stop flag
PR_SET_PDEATHSIG = 1


@dataclass
class CoreConfig:
    worker: dict  # DistributedWorker's keyword arguments
    control: str  # the control ROUTER's endpoint (the core binds it)
    outputs: list[str]  # each API server's outputs PULL endpoint, by index (they bind them)
    parent_pid: int
    engine: int = 0  # its data-parallel rank: the `engine` label of its metrics
    cpu_cores: list[int] | None = None  # its share of the machine's cores (data parallel on a cpu)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CoreConfig":
        return cls(**json.loads(text))


class EngineCore:
    def __init__(self, config: CoreConfig, worker: DistributedWorker):
        self.config = config
        self.worker = worker
        self.engine = worker.engine
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(config.control)
        self.pushes = []
        for endpoint in config.outputs:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # a slow API server must never block the step loop
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(endpoint)
            self.pushes.append(push)
        self.owner: dict[str, int] = {}  # request id -> the API server it came from
        self.stop = threading.Event()
        self._closing = False  # close() ran (it may be called from the parent-death watch and the main path)
        self._healthy: bool | None = None
        self._thread: threading.Thread | None = None
        self._weight_version = worker.weight_version  # as the API servers know it
        # Two threads: a long control (a weight update) does not hold up a short one (is_sleeping).
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="l3worker-control")
        self._done_calls: deque[tuple[bytes, int, Future]] = deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # a finished call wakes the poll
        self._wake_lock = threading.Lock()  # no write to a closed (and perhaps reused) descriptor

    def run(self) -> None:
        """Prepares the worker, then serves until stopped or orphaned; stops everything it started."""
        parent = os.pidfd_open(self.config.parent_pid)
        try:
            self.worker.prepare()
            move_threads_off(self.worker.step_core)  # the core of the chip-child's step thread is its own
            if os.environ.get(STEP_TRACE_ENV):
                self.engine.output_processor.recorder = GenerateStats()
            self.engine.driven_by_loop_thread = True
            self._thread = threading.Thread(target=run_step_loop, name="l3worker-engine", daemon=True,
                                            args=(self.worker, self.stop.is_set, self._publish, self._dead))
            self._thread.start()
            poller = zmq.Poller()
            poller.register(self.control, zmq.POLLIN)
            poller.register(parent, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while not self.stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if parent in ready:
                    log.warning("the API server that started the engine core is gone: stopping")
                    break
                if self._wake_r in ready:
                    self._reply_calls()
                while self.control.poll(0):
                    who, data = self.control.recv_multipart()
                    try:
                        self._handle(who, unpack(data))
                    except Exception:  # one bad message must not take the engine down
                        log.exception("control message from %s failed", who.decode(errors="replace"))
                self._send_health()
        finally:
            os.close(parent)
            self.close()

    def close(self) -> None:
        """Idempotent; the socket directory goes (when this core outlived its parent) whatever fails before."""
        if self._closing:
            return
        self._closing = True
        try:
            self.stop.set()
            self.engine.request_stop()  # a control waiting for the loop thread gives up
            self._calls.shutdown(wait=False, cancel_futures=True)
            if self._thread is not None:
                self._thread.join(30)
            self._write_step_trace()
            self.worker.close()
            self.ctx.destroy(linger=1000)
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1
        finally:
            if os.getppid() != self.config.parent_pid:  # nobody else is left to remove its socket directory
                shutil.rmtree(os.path.dirname(self.config.control.removeprefix("ipc://")), ignore_errors=True)

    def _write_step_trace(self) -> None:
        recorder, path = self.engine.output_processor.recorder, os.environ.get(STEP_TRACE_ENV)
        if recorder is not None and path:
            with open(path, "w") as f:
                json.dump(recorder.step_table(), f)

    # -- the control socket (main thread) -----------------------------------------------------------
    def _handle(self, who: bytes, msg: list) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(who, *msg[1:])
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "metrics":
            self._reply(who, ["metrics", msg[1], families_to_wire(self.engine.metrics.registry, self.config.engine)])
        elif kind == "control":
            self._control(who, *msg[1:])
        elif kind == "hello":
            self._reply(who, ["ready", self.engine.healthy, self.worker.cpu_layout_in_use,
                              self.engine.unavailable_reason, self.worker.weight_version, self.worker.step_core])
        elif kind == "shutdown":
            self.stop.set()
        else:
            log.error("unknown control message %r", kind)

    def _add(self, who: bytes, request_id: str, prompt: list[int], params: list, lora: list | None = None) -> None:
        previous = self.owner.get(request_id)
        # Owned before it is queued: the loop thread may finish it before submit returns.
        self.owner[request_id] = int(who.decode().removeprefix("api-"))
        try:
            state = self.engine.make_request(prompt, params_from_wire(params), request_id, True, "prompt",
                                             lora_request=None if lora is None else LoRARequest(*lora))
            self.engine.submit(state)
        except (ValueError, TypeError, EngineBusyError, EngineDeadError) as e:
            if previous is None:
                self.owner.pop(request_id, None)
            else:
                self.owner[request_id] = previous
            self._reply(who, ["refused", request_id, error_kind(e), str(e)])

    def _control(self, who: bytes, seq: int, name: str, args: dict) -> None:
        """Runs a rollout control on a thread of its own; _reply_calls answers it when done."""
        def done(future: Future) -> None:  # on the call's thread: only the main thread sends
            self._done_calls.append((who, seq, future))
            with self._wake_lock:
                if self._wake_w >= 0:  # else the core stopped: nobody waits for the reply
                    try:
                        os.write(self._wake_w, b"\0")
                    except BlockingIOError:  # the pipe is full of wake-ups already
                        pass

        self._calls.submit(run_control, self.worker, name, args).add_done_callback(done)

    def _reply_calls(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while self._done_calls:
            who, seq, future = self._done_calls.popleft()
            try:
                reply = ["control", seq, True, future.result(), None]
            except BaseException as e:  # the API server answers it (400, 503, 500)
                if error_kind(e) == "error":
                    log.exception("control %d failed", seq)
                reply = ["control", seq, False, str(e), error_kind(e)]
            self._send_weight_version()  # before the reply: a response after it reports the new version
            self._reply(who, reply)

    def _send_weight_version(self) -> None:
        version = self.worker.weight_version
        if version != self._weight_version:
            self._weight_version = version
            for index in range(len(self.pushes)):
                self._reply(identity(index), ["weight_version", version])

    def _reply(self, who: bytes, message: list) -> None:
        self.control.send_multipart([who, pack(message)])

    def _send_health(self) -> None:
        """Tells every API server when the engine's health changes (a restart begins or ends, a failure)."""
        healthy = self.engine.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            for index in range(len(self.pushes)):
                self._reply(identity(index), ["health", healthy, self.engine.unavailable_reason])

    # -- the loop thread ---------------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        """One message per API server with outputs this step."""
        batches: dict[int, list] = {}
        for out in outputs:
            index = self.owner.pop(out.request_id, None) if out.finished else self.owner.get(out.request_id)
            if index is not None:
                batches.setdefault(index, []).append(output_to_wire(out))
        for index, items in batches.items():
            self.pushes[index].send(pack(["out", items]))

    def _dead(self, exc: BaseException) -> None:
        log.error("the engine stopped: %s", exc)
        for push in self.pushes:
            push.send(pack(["dead", str(exc)]))


def _sigterm_when_parent_dies() -> None:
    """A parent killed outright while this process still prepares: SIGTERM, which ends start-up."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def main(early: EarlyChild | None = None) -> int:
    """`early`: a cpu chip-child started ahead, which the worker's first launch takes; any exit
    before that ends it (start_early_child's exit hook)."""
    text = sys.stdin.read()
    if not text:  # started early, and the arguments were refused
        return 0
    config = CoreConfig.from_json(text)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launching API server's to handle
    core: EngineCore | None = None

    def on_sigterm(signum, frame) -> None:
        if core is None or core._thread is None:
            raise SystemExit(0)  # still starting: run() stops what it started on the way out
        core.stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    _sigterm_when_parent_dies()
    if os.getppid() != config.parent_pid:
        return 0
    if config.cpu_cores:
        # Before any thread starts: the worker sizes and pins its children within this share.
        os.sched_setaffinity(0, config.cpu_cores)
    worker = DistributedWorker(**config.worker)
    worker.early_child = early
    try:
        core = EngineCore(config, worker)
    except BaseException:
        worker.close()
        raise
    core.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(EARLY_CHILD))
