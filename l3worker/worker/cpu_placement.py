"""Where a worker's cpu children and its own socket threads run (chip_child.cpu_layout has the
why): the layout, the children's intra-op threads, the core plan that pins them, and the start-up
trial of `cpu_layout="auto"`.

Under `auto` the children start in the layout the timing-free rule prefers, set up exactly as a
worker with that layout fixed sets them up (threads, pins, socket threads), and the trial moves
them only where the other layout clearly wins or the machine is loaded. A child that started as
`spare_core` and moved to every core ran 1.0-1.2x the time per token of a worker with
`every_core` fixed on a quiet machine, with its socket threads and the parent's left pinned to
the spare core; starting in the preferred layout leaves nothing to differ when the trial keeps it.
Restarts run the layout the first start chose, untimed.
"""
from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field

from chip_child.cpu_layout import LayoutCores, preferred_cpu_layout, read_trial
from chip_child.device import CorePlan, allowed_cores, default_cpu_threads, plan_cores, repin_socket_threads

# The trial times a prompt and two decode steps: a cache must hold three positions.
TRIAL_MIN_POSITIONS = 3
# The machine-wide name under which a worker holds its step core: workers with different names do
# not see each other's claims (the test suite gives each of its parallel workers one of its own).
CORE_CLAIMS_ENV = "L3WORKER_CORE_CLAIMS"


def claim_core(core: int) -> socket.socket | None:
    """Holds `core` as one worker's step core, machine-wide, or None where another process (or
    worker) holds it: an abstract Unix socket's name, which the kernel frees with the socket, so a
    worker that dies leaves no claim and no file behind. Another server, script or data-parallel
    engine on the same cores then leaves that core to the first and pins nothing of its own."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # not inherited by the children (PEP 446)
    try:
        sock.bind(f"\0{os.environ.get(CORE_CLAIMS_ENV) or 'l3worker'}-step-core-{core}")
    except OSError:
        sock.close()
        return None
    return sock


@dataclass
class CpuPlacement:
    layout: str  # asked for: "auto", "every_core" or "spare_core"
    num_threads: int | None  # asked for: fixes the children's threads (no trial)
    pin_cores: bool
    on_cpu: bool
    step_weights: int  # chip_child.cpu_layout.step_weight_elements of the model
    tensor_parallel_size: int
    reachable_positions: int
    chosen: str | None = None  # what the trial chose; later starts run it
    # The cores the worker was made with: a serving process moves its threads off the step core
    # after the first start (chip_child.device.move_threads_off), and a restart still counts all.
    cores: list[int] = field(default_factory=lambda: allowed_cores())
    _claim: socket.socket | None = field(default=None, repr=False)  # the step core's, while held

    def times(self) -> bool:
        """Whether the next start runs the trial: one child (tensor-parallel ranks step together
        and keep spare_core), more than one core, room in the cache, and no choice made yet."""
        return (self.on_cpu and self.layout == "auto" and self.num_threads is None and self.tensor_parallel_size == 1
                and self.chosen is None and len(self.cores) >= 2
                and self.reachable_positions >= TRIAL_MIN_POSITIONS)

    def start_layout(self) -> str:
        """The layout the next start sets up: the one asked for; under auto the trial's choice,
        else the rule's preference where the trial runs, else spare_core."""
        if self.layout != "auto":
            return self.layout
        if self.chosen is not None:
            return self.chosen
        if self.times():
            return preferred_cpu_layout(self.step_weights, len(self.cores))
        return "spare_core"

    def threads(self, children: int) -> int | None:
        """Intra-op threads per cpu child (None off the cpu)."""
        if not self.on_cpu:
            return None
        return self.num_threads or default_cpu_threads(children, self.start_layout(), len(self.cores))

    def plan(self, children: int, others_pinned: bool) -> CorePlan | None:
        """Cores for the cpu children and the rest for socket threads, where their threads leave
        one over; None where nothing is pinned (off the cpu, pin_cores=False, or another worker
        of this process holds its cores: both would pick the same ones)."""
        if not self.pin_cores or not self.on_cpu or others_pinned:
            return None
        return plan_cores(children, self.threads(children), self.cores)

    def trial(self, others_pinned: bool) -> dict | None:
        """What the child needs for the trial (chip_child.child_spec.ChildSpec.layout_trial), or None."""
        if not self.times():
            return None
        every = self.cores
        spare = plan_cores(1, default_cpu_threads(1, "spare_core", len(every)), every) \
            if self.pin_cores and not others_pinned else None
        cores = LayoutCores(every=every, spare=spare.children[0] if spare else every,
                            service=spare.service if spare else [])
        return {"preferred": self.start_layout(), **asdict(cores)}

    def step_core(self, children: int, others_pinned: bool) -> int | None:
        """The core a lone cpu child's step thread gets to itself where it runs every_core (fixed,
        or as the trial may choose), with the parent's socket threads on the others: the first,
        claimed for this worker's life (claim_core). None where nothing is pinned, there is no
        other core, the platform has no affinity masks or another worker holds that core."""
        if self._claim is not None:  # a restart: the core the first start took
            return self.cores[0]
        every_core = self.start_layout() == "every_core" or self.times()
        if not (self.on_cpu and self.pin_cores and every_core) or others_pinned or children != 1 \
                or self.tensor_parallel_size != 1 or len(self.cores) < 2 or not hasattr(os, "sched_setaffinity"):
            return None
        self._claim = claim_core(self.cores[0])
        return self.cores[0] if self._claim is not None else None

    def release(self) -> None:
        """Gives the step core back (the worker closed, or its child did not take it)."""
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def started(self, trial: dict | None, chosen: str | None, step_core: int | None = None) -> None:
        """After a start: keep the trial's choice for later starts, and move this process's socket
        threads where a worker started with that layout would have them (off the step core)."""
        if trial is not None and chosen is not None:
            self.chosen = chosen
            if chosen != trial["preferred"]:
                repin_socket_threads(read_trial(trial)[1].socket_cores(chosen))
        if step_core is not None:
            repin_socket_threads([c for c in self.cores if c != step_core])
        else:  # the trial chose spare_core, or the child could not pin its threads
            self.release()

    def in_use(self, info: dict, children: int) -> str | None:
        """The layout `children` cpu children whose first reported `info` run with: what the
        trial chose (this start's or the first's), else the one asked for, else (auto without a
        trial) what their threads amount to. None off the cpu."""
        if info.get("device") != "cpu":
            return None
        chosen = info.get("cpu_layout") or self.chosen
        if chosen:
            return chosen
        if self.layout != "auto":
            return self.layout
        return "every_core" if info.get("threads", 1) * children >= len(self.cores) else "spare_core"

    def spin_budget(self, info: dict, children: int, spin_wait_s: float) -> float:
        """How long the parent spins on the doorbell: only where a core is free for it (on
        accelerators, or where the cpu children's threads leave one); a spinning parent inside a
        child's OpenMP team slows every step."""
        if info.get("device") == "cpu":
            cores = len(self.cores)
            if info.get("threads", cores) * children >= cores:
                return 0.0
        return spin_wait_s
