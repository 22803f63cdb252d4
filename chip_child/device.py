"""Device selection and the few calls that differ between cpu, cuda and npu."""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from chip_child.config import CPU_LAYOUTS, DEVICE_TYPES


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available() and torch.npu.device_count() > 0


def check_optional_bool(name: str, value: object) -> None:
    """The check of a switch whose None means "the device decides"."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")


def device_type(device: str) -> str:
    """What `device` resolves to, without opening anything: `auto` picks npu (torch_npu
    importable and a device present), then cuda, then cpu."""
    if device not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES}, got {device!r}")
    if device != "auto":
        return device
    if _npu_available():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_page_size(kind: str) -> int:
    """Tokens per KV page when the caller names none. The CPU takes pages of 16: the prefix cache
    hits whole pages (a 128-token prompt sent again reuses 112 tokens, none with pages of 128), and
    a decode step costs about the same on either (docs/performance/peers.md). NPUs' attention wants
    128 for prefill; GPUs keep 128 until pages of 16 are measured there."""
    return 16 if kind == "cpu" else 128


def resolve_device(device: str, device_id: int = 0) -> torch.device:
    device = device_type(device)
    if device == "cpu":
        return torch.device("cpu")
    if device == "npu":
        import torch_npu  # noqa: F401

        count = torch.npu.device_count()
    else:
        count = torch.cuda.device_count()
    if not 0 <= device_id < count:
        raise ValueError(f"device_ids: {device} device {device_id} does not exist ({count} present)")
    dev = torch.device(device, device_id)
    getattr(torch, device).set_device(dev)
    return dev


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    return len(allowed_cores())


def default_cpu_threads(children: int, layout: str = "spare_core", cores: int | None = None) -> int:
    """Threads per cpu child for a layout, out of `cores` (default: every core this process may
    use). `every_core`: every core, shared among the children (torch's own default); the parent
    then has no core of its own and sleeps through each step. `spare_core`: the same less one
    core, for the parent and the socket threads. `auto` starts as `spare_core` (see
    chip_child.cpu_layout)."""
    if layout not in CPU_LAYOUTS:
        raise ValueError(f"cpu_layout must be one of {CPU_LAYOUTS}, got {layout!r}")
    spare = 0 if layout == "every_core" else 1
    return max(1, ((cores or available_cores()) - spare) // children)


@dataclass(frozen=True)
class CorePlan:
    """Cores of their own for each cpu child's threads; the rest (`service`) for the parent and
    every ZeroMQ socket thread, in the parent and in the children."""

    service: list[int]
    children: list[list[int]]


def plan_cores(children: int, threads: int | None, cores: list[int] | None = None) -> CorePlan | None:
    """Socket threads wake on every command; left to the scheduler they can land on a child's
    core and preempt its step. None where the children's threads leave no core over (of `cores`,
    default: this process's), or on a platform without affinity masks."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = cores or allowed_cores()
    threads = threads or default_cpu_threads(children, cores=len(cores))
    spare = len(cores) - children * threads
    if spare < 1:
        return None
    rest = cores[spare:]
    return CorePlan(cores[:spare], [rest[i * threads:(i + 1) * threads] for i in range(children)])


def pin_socket_threads(ctx: zmq.Context, cores: list[int]) -> None:
    """Keeps a ZeroMQ context's background threads on `cores`; call before its first socket.
    A libzmq without the option (before 4.3) leaves them where the scheduler puts them."""
    option = getattr(zmq, "THREAD_AFFINITY_CPU_ADD", None)
    try:
        for core in cores if option is not None else ():
            ctx.set(option, core)
    except zmq.ZMQError:
        pass


# libzmq (4.3 on) names its background threads "ZMQbg/IO/0", "ZMQbg/Reaper": how a thread that
# already runs is told apart from the process's own (OpenMP workers, the main thread).
SOCKET_THREAD_PREFIX = "ZMQbg/"


def is_socket_thread(name: str) -> bool:
    return name.startswith(SOCKET_THREAD_PREFIX)


def process_threads() -> dict[int, str]:
    """Every thread of this process and its name; empty where the platform has no /proc."""
    threads = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                threads[int(tid)] = f.read().strip()
        except OSError:  # a thread that just ended
            pass
    return threads


def repin_socket_threads(cores: list[int]) -> None:
    """Moves the ZeroMQ threads already running in this process to `cores` (pin_socket_threads
    acts on a context before its threads start; this, after a layout changed under them)."""
    pin_threads(lambda _, name: cores if is_socket_thread(name) else [])


def pin_threads(mask_of: Callable[[int, str], list[int]]) -> bool:
    """Every thread of this process on the cores `mask_of(tid, name)` gives (skipped where empty).
    False where the platform has no affinity masks or no /proc to list the threads by."""
    threads = process_threads() if hasattr(os, "sched_setaffinity") else {}
    for tid, name in threads.items():
        mask = mask_of(tid, name)
        try:
            if mask:
                os.sched_setaffinity(tid, mask)
        except OSError:  # a thread that just ended
            pass
    return bool(threads)


def pin_step_thread(step_core: int, cores: list[int]) -> bool:
    """A cpu child's step thread (the caller) alone on `step_core`, every other thread of the
    process (its OpenMP workers, the decode step's team, socket threads) on the rest of `cores`:
    the serving processes' threads keep off the step core too (move_threads_off), so their
    wake-ups at every token land beside the helpers, which a step never waits for, and not on the
    thread that runs the step. False where nothing could be pinned."""
    me, rest = threading.get_native_id(), [c for c in cores if c != step_core]
    return pin_threads(lambda tid, _: [step_core] if tid == me else rest)


def keep_off_step_core(step_core: int, rest: list[int]) -> None:
    """Threads the step thread started since pin_step_thread (a grammar's compile pool, a library's
    thread pool made on first use) inherited its one core: moves them to `rest`."""
    me = threading.get_native_id()

    def mask_of(tid: int, _: str) -> list[int]:
        try:
            return rest if tid != me and os.sched_getaffinity(tid) == {step_core} else []
        except OSError:  # a thread that just ended
            return []
    pin_threads(mask_of)


def move_threads_off(step_core: int | None) -> list[int]:
    """Every thread of this process (and the threads and processes it starts from then on) on
    this thread's cores less a cpu child's `step_core`; none moved where there is no step core or
    no other core. Returns the cores they run on."""
    mask = [c for c in allowed_cores() if c != step_core]
    if step_core is not None and mask:
        pin_threads(lambda *_: mask)
    return mask or allowed_cores()


def synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        getattr(torch, dev.type).synchronize(dev)


class DeviceTimer:
    """Times device work: events on accelerators, wall clock on the cpu (where work is synchronous)."""

    def __init__(self, dev: torch.device):
        self._events = None
        if dev.type != "cpu":
            backend = getattr(torch, dev.type)
            self._events = (backend.Event(enable_timing=True), backend.Event(enable_timing=True))
        self._t0 = 0.0
        self._elapsed = 0.0

    def start(self) -> None:
        if self._events:
            self._events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events:
            self._events[1].record()
        else:
            self._elapsed = time.perf_counter() - self._t0

    def elapsed_s(self) -> float:
        """Call after the step's final synchronisation (the copy of the sampled ids)."""
        if self._events:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._elapsed


def tensor_parallel_all_reduce(device_type: str, dist_init: str | None, rank: int, world: int):
    """The all-reduce a sharded layer ends with: joins torch.distributed's group (gloo, nccl or
    hccl by device) when `world` > 1; the identity otherwise."""
    if world == 1:
        return lambda x: x
    import torch.distributed as dist

    backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device_type]
    dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=world)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    return all_reduce
