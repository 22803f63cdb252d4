"""The chip-child process: opens its device, builds a ChipRuntime, then applies one command per
message until told to stop or its parent disappears.

Started by the parent as `python -m chip_child SPEC_JSON` with the shared buffers' descriptors
inherited. After each step rank 0 writes the sampled ids, any log-probabilities asked for and
the step's figures into the step's ring slot and rings the shared doorbell; a failed or refused
command gets an error reply naming the problem, and a bad command is refused before anything is
applied.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zmq

from chip_child import protocol
from chip_child.config import RuntimeConfig
from chip_child.cpu_kernels import huge_pages
from chip_child.cpu_layout import choose_cpu_layout, read_trial
from chip_child.device import keep_off_step_core, pin_socket_threads, pin_step_thread
from chip_child.step.controls import RuntimeControls
from chip_child.step.host_kv import HostKV
from chip_child.step.runtime import ChipRuntime, LaunchedStep, StepOutputs
from chip_child.child_spec import ChildSpec
from chip_child.spec_handover import EARLY_FLAG, receive_spec

PR_SET_PDEATHSIG = 1
PARENT_CHECK_MS = 500
# Every this many steps the step thread moves threads it started since (they inherit its one core)
# off its core: a listing of the process's threads, about 20 us.
KEEP_OFF_EVERY = 64
# The start-up layout trial (cpu_layout="auto"), per layout and round: a prefill step of up to
# this many tokens (the step budget, if smaller), then at most this many decode steps timed, fewer
# past this many seconds.
LAYOUT_PREFILL_TOKENS, LAYOUT_STEPS, LAYOUT_BUDGET_S = 256, 4, 0.1


def open_shared(spec: list) -> torch.Tensor:
    """Maps a buffer the parent made with share_memory_() from its inherited descriptor."""
    fd, nbytes, shape, dtype = spec
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage).view(*shape)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the parent goes, and exit on it only once reparented.

    PR_SET_PDEATHSIG fires when the *thread* that started this child ends, which can be before
    its process is gone, or while the process lives on; so the handler checks the parent pid,
    and the poll loop in StepLoop.run checks it too, for a signal that came too early."""

    def on_sigterm(signum, frame):
        if os.getppid() != parent_pid:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _parse_fault(fault: str) -> tuple[str, str, str]:
    target, _, rule = fault.rpartition(":")
    kind, at = rule.split("@")
    return target or "decode", kind, at


def _fault(kind: str, where: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"injected fault in {where}")
    if kind == "hang":
        time.sleep(3600)
    if kind == "exit":
        os._exit(3)


def _inject_fault(rt: ChipRuntime, fault: str) -> None:
    """Test-only: "[CALLABLE:]KIND@N" makes the registered callable (default decode) raise, hang or
    exit on every call after its N-th real one (warm-up calls do not count); "KIND@first=T" on
    every call whose chunks hold a prompt that starts with token id T (a poison request). The
    target "startup" faults once the runtime is built and warmed up, before the ready report."""
    target, kind, at = _parse_fault(fault)
    if target == "startup":
        _fault(kind, "start-up")
        return
    original = rt._callables[target]
    calls = {"n": 0}
    poison = int(at.removeprefix("first=")) if at.startswith("first=") else None

    def poisoned(plan, chunk_ints) -> bool:
        if plan is None:
            return False
        parts = plan.layout.unpack(chunk_ints)
        return bool(((parts.ids == poison) & (parts.positions == 0)).any())

    def faulty(**kwargs):
        calls["n"] += 1
        if poison is None and calls["n"] > int(at) or \
                poison is not None and poisoned(kwargs.get("plan"), kwargs.get("chunk_ints")):
            _fault(kind, f"{target} call {calls['n']}")
        return original(**kwargs)

    rt.register_callable(target, faulty)


def start_runtime(spec: ChildSpec) -> tuple[ChipRuntime, dict]:
    """Opens the device and builds the runtime (weights, KV cache, warm-up); with layout_trial,
    times the cpu layouts first. Returns the runtime and what the trial chose."""
    if spec.cpu_cores:
        os.sched_setaffinity(0, spec.cpu_cores)  # before torch starts its thread pool
    rt = ChipRuntime(RuntimeConfig(**spec.runtime))
    try:
        layout = {"layout": None, "preferred": None, "step_s": None, "other_cores": None, "trial_s": None}
        if spec.layout_trial:
            preferred, cores = read_trial(spec.layout_trial)
            layout = choose_cpu_layout(lambda: rt.time_steps(LAYOUT_PREFILL_TOKENS, LAYOUT_STEPS, LAYOUT_BUDGET_S),
                                       cores, preferred)
            rt.reset()
        # The cores the child's threads run on, before the step thread has one to itself.
        layout["cores"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        layout["step_core"] = spec.step_core if layout["layout"] in (None, "every_core") else None
        if layout["step_core"] is not None and not pin_step_thread(layout["step_core"], layout["cores"]):
            layout["step_core"] = None
        if spec.fault:
            _inject_fault(rt, spec.fault)
    except BaseException:
        rt.close()
        raise
    return rt, layout


def ready_message(rt: ChipRuntime, layout: dict) -> bytes:
    """The start-up report: what the parent's stats() show of this child."""
    return msgpack.packb({
        "ready": True, "pid": os.getpid(), "device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."),
        "setup_s": rt.setup_s, "pool_bytes": rt.pool.nbytes, "threads": torch.get_num_threads(),
        "attention_backend": rt.attn.name, "decode_graphs": list(rt.graphs.lanes) if rt.graphs else [],
        "fused_kernels": rt.ops.name, "cpu_prepack": rt.cpu_prepack,
        "cpu_linear": rt.cpu_linear, "moe_experts": rt.weights.held_experts(),
        "cpu_huge_pages": (huge_pages.STATS.to_dict() if rt.cpu_linear in ("amx_bf16", "avx512_bf16", "avx2_bf16")
                           else None),
        # per fused kernel: [name, relative error of its self-check (None: forced off), whether it runs]
        "kernel_checks": [[v.kernel, v.error, v.used] for v in rt.kernel_checks],
        "cores": layout["cores"],
        "cpu_layout": layout["layout"], "layout_preferred": layout["preferred"], "layout_step_s": layout["step_s"],
        "layout_other_cores": layout["other_cores"], "layout_trial_s": layout["trial_s"],
        "step_core": layout["step_core"],
    })


@dataclass
class Ring:
    """This child's views of the shared ring, per slot, made once."""

    out: list[torch.Tensor]  # where a step's sampled ids go (a private buffer off rank 0)
    staging: list[np.ndarray]  # the step's prompt ids
    # Log-probabilities are computed and written by rank 0 alone: the other ranks get None.
    outputs: list[StepOutputs | None]
    step_stats: np.ndarray  # [slots, 5]
    doorbell: np.ndarray  # see l3worker.worker.doorbell

    @property
    def slots(self) -> int:
        return len(self.out)


def map_ring(spec: ChildSpec) -> Ring:
    sampled = open_shared(spec.buffers["sampled"])
    leader = spec.rank == 0  # tensor-parallel peers sample the same ids; rank 0 alone reports them
    if not leader:
        sampled = torch.zeros_like(sampled)
    outputs: list[StepOutputs | None] = [None] * sampled.shape[0]
    names = ("logprobs", "logprob_ids", "prompt_logprobs", "prompt_logprob_ids")
    if leader and all(n in spec.buffers for n in names):
        views = [open_shared(spec.buffers[n]).unbind(0) for n in names]
        outputs = [StepOutputs(*per_slot) for per_slot in zip(*views)]
        if "spec_counts" in spec.buffers:  # speculative decoding: each row's tokens of the step
            for name in ("spec_counts", "spec_ids", "spec_logprobs", "spec_logprob_ids"):
                for out, view in zip(outputs, open_shared(spec.buffers[name]).unbind(0)):
                    setattr(out, name, view)
    return Ring(out=list(sampled.unbind(0)), staging=list(open_shared(spec.buffers["staging"]).numpy()),
                outputs=outputs, step_stats=open_shared(spec.buffers["step_stats"]).numpy(),
                doorbell=open_shared(spec.buffers["doorbell"]).numpy())


class StepLoop:
    """Applies one command per message, in order, until Shutdown or the parent is gone.

    A step is published (its ids and figures in its ring slot, then the doorbell) only once the
    next command was launched behind it, or when none is waiting: on an accelerator the device
    never idles while this loop receives, publishes and launches. After a failed step the device
    state is suspect: every later command is refused, each with an error reply."""

    def __init__(self, spec: ChildSpec, sock: zmq.Socket, rt: ChipRuntime, ring: Ring, overlap: bool, layout: dict):
        self.spec = spec
        self.step_core: int | None = layout["step_core"]  # this thread's core of its own (start_runtime)
        self.rest = [c for c in layout["cores"] or () if c != self.step_core]
        self.sock = sock
        self.rt = rt
        self.ring = ring
        self.overlap = overlap  # launch a step before completing the last
        self.leader = spec.rank == 0
        self.failed: str | None = None  # why later commands are refused
        self.pending: tuple[int, LaunchedStep] | None = None  # (step, its launch): launched, not yet published
        self.controls: RuntimeControls | None = None  # made at the first control
        self.host_kv: HostKV | None = None  # the host tier's pages, made at the first copies

    def run(self) -> None:
        sock, limits = self.sock, self.rt.limits
        while True:
            try:  # with run-ahead the next command is usually queued already: skip the poll
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if self.publish():  # nothing to launch behind it: publish it now
                    continue
                if not sock.poll(PARENT_CHECK_MS) and os.getppid() != self.spec.parent_pid:
                    return
                continue
            try:
                cmd = protocol.decode(raw, limits)
            except protocol.ProtocolError as exc:
                self.publish()
                self.report(None, f"bad command: {exc}", "")
                continue
            if isinstance(cmd, protocol.Shutdown):
                self.publish()
                return
            if isinstance(cmd, protocol.Control):
                self.publish()
                self.control(cmd)
                continue
            if isinstance(cmd, protocol.Copies):
                self.copies(cmd)
                continue
            if isinstance(cmd, protocol.LoraLoad):
                self.lora_load(cmd)
                continue
            self.launch(cmd)

    def copies(self, cmd: protocol.Copies) -> None:
        """Host-tier page copies, in order before the next command (a failure fails the child)."""
        if self.failed is not None:
            return  # the next command is refused anyway
        if self.host_kv is None:
            self.host_kv = HostKV(self.rt.state["kv_cache"], self.rt.attn.cache_layout, self.rt.limits.host_pages)
        self.publish()
        try:
            self.host_kv.apply(cmd.copies)
            self.rt.attn.invalidate()
        except Exception as exc:
            self.failed = f"host-tier copies failed ({type(exc).__name__}: {exc})"
            self.report(None, f"copies: {type(exc).__name__}: {exc}", traceback.format_exc())

    def lora_load(self, cmd: protocol.LoraLoad) -> None:
        """An adapter into its slot before the next command (a failure fails the child)."""
        if self.failed is not None:
            return
        self.publish()
        try:
            if self.rt.lora is None:
                raise ValueError("this runtime has no LoRA slots (max_loras=0)")
            self.rt.lora.load(cmd.slot, cmd.path)
        except Exception as exc:
            self.failed = f"LoRA load failed ({type(exc).__name__}: {exc})"
            self.report(None, f"lora: {type(exc).__name__}: {exc}", traceback.format_exc())

    def control(self, cmd: protocol.Control) -> None:
        """Runs a control and replies with its results; input it cannot take is refused and the
        child goes on; a failure half-way (weights half copied) is a failed child."""
        if self.failed is not None:
            self.report(None, f"refused: {self.failed}", "")
            return
        if self.controls is None:
            self.controls = RuntimeControls(self.rt)
        try:
            result = self.controls.handle(cmd.name, cmd.args)
        except ValueError as exc:
            self.sock.send(msgpack.packb({"control": cmd.name, "refused": str(exc)}))
            return
        except Exception as exc:
            self.failed = f"control {cmd.name} failed earlier ({type(exc).__name__}: {exc})"
            self.report(None, f"{cmd.name}: {type(exc).__name__}: {exc}", traceback.format_exc())
            return
        self.sock.send(msgpack.packb({"control": cmd.name, **result}))

    def launch(self, cmd: protocol.Command) -> None:
        """Launches a step, then publishes the one before it."""
        if self.failed is not None:
            self.refuse(cmd.step)
            return
        slot = cmd.step % self.ring.slots
        try:
            launched = self.rt.launch(cmd, self.ring.staging[slot], self.ring.out[slot], self.ring.outputs[slot])
        except Exception as exc:
            self.publish()
            self.fail(cmd.step, exc)
            return
        self.publish()
        if self.failed is not None:  # the step before it failed: this one ran on suspect state
            self.refuse(cmd.step)
            return
        self.pending = (cmd.step, launched)
        if not self.overlap:
            self.publish()
        if self.step_core is not None and cmd.step % KEEP_OFF_EVERY == 0:
            keep_off_step_core(self.step_core, self.rest)

    def publish(self) -> bool:
        """Completes the pending step, if any, and tells the parent (steps are published in
        order); False when none was pending."""
        if self.pending is None:
            return False
        step, launched = self.pending
        self.pending = None
        try:
            r = self.rt.complete(launched)
        except Exception as exc:
            self.fail(step, exc)
            return True
        if self.leader:
            ring = self.ring
            ring.step_stats[step % ring.slots] = (r.apply_s * 1e6, r.device_s * 1e6, r.h2d_copies, r.h2d_bytes,
                                                  r.pool_allocs)
            ring.doorbell[0] = step + 1  # after the ids and figures: x86 keeps stores in order
            if self.spec.wake_fd is not None:  # one syscall, no socket thread: every step, so none is lost
                os.eventfd_write(self.spec.wake_fd, 1)
            # A socket message costs tens of microseconds to send: only a sleeping parent gets one.
            elif self.spec.wake_every_step or 0 <= ring.doorbell[1] <= step:
                self.sock.send(protocol.encode_wakeup(step))
        return True

    def fail(self, step: int, exc: Exception) -> None:
        """A step raised: reports it, and refuses every later command."""
        self.failed = f"step {step} failed earlier ({type(exc).__name__}: {exc})"
        self.report(step, f"{type(exc).__name__}: {exc}", traceback.format_exc())

    def refuse(self, step: int) -> None:
        self.report(step, f"refused: {self.failed}", "")

    def report(self, step: int | None, message: str, tb: str) -> None:
        """An error reply to the parent."""
        self.sock.send(protocol.encode_error(step, message, tb))
        self.ring.doorbell[2] = 1  # after the message: a parent that sees the flag finds the message


def serve(spec: ChildSpec) -> None:
    """Start-up, then the step loop; every exit path closes the runtime and the socket."""
    ctx = zmq.Context()
    pin_socket_threads(ctx, spec.service_cores or [])
    sock = ctx.socket(zmq.PAIR)
    # A bounded linger: the last reply (a start-up error, say) must still reach the parent.
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(spec.endpoint)
    rt = None
    try:
        try:
            rt, layout = start_runtime(spec)
        except Exception as exc:
            sock.send(protocol.encode_error(None, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            return
        ring = map_ring(spec)
        sock.send(ready_message(rt, layout))
        overlap = spec.overlap_steps if spec.overlap_steps is not None else rt.device.type != "cpu"
        if overlap and rt.spec is not None:  # a speculative step's lengths come from the one before
            print("chip-child: speculative decoding runs its steps in order (overlap_steps off)", file=sys.stderr,
                  flush=True)
            overlap = False
        StepLoop(spec, sock, rt, ring, overlap, layout).run()
    finally:
        if rt is not None:
            rt.close()
        sock.close()
        ctx.term()


def read_spec(argv: list[str]) -> ChildSpec | None:
    """The spec: argv's, or, for a child started ahead of it, what arrives on stdin (a socket
    pair), None when the pair closed first."""
    if argv[1:] != [EARLY_FLAG]:
        return ChildSpec.from_json(argv[1])
    with socket.socket(fileno=0) as stdin:
        spec = receive_spec(stdin)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # stdin as a child started with its spec has it
    os.close(null)
    if spec is not None:
        # A session of its own, as a child started with its spec has: where the kernel groups
        # processes by session for scheduling (autogroup), sharing the engine core's group would
        # halve the child's share of the cores whenever the core is busy too.
        os.setsid()
    return spec


def main(argv: list[str]) -> None:
    spec = read_spec(argv)
    if spec is None:  # an early child its parent did not use
        exit_without_teardown()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_when_orphaned(spec.parent_pid)
    try:
        if os.getppid() == spec.parent_pid:
            serve(spec)
    finally:
        # Orphaned, while starting or serving (the SIGTERM handler's SystemExit included): nobody
        # else will remove the socket files, the one the parent bound among them.
        if os.getppid() != spec.parent_pid:
            shutil.rmtree(spec.socket_dir, ignore_errors=True)
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Exits once serve() released what the child owns (runtime, socket, context): the exit
    handlers run and the standard streams are flushed, but not the interpreter's teardown of
    torch's modules, which takes about 0.45 s here and would be paid by every close() and
    restart the parent waits on."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
