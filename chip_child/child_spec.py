"""What the parent tells one chip-child at start-up: built once per rank, read by the child.

The parent passes it as the child's only argument (JSON); both sides use this one class, so a
field is added in one place. It imports nothing heavy: the parent builds it before any child
starts, and the runtime config travels as the fields of chip_child.step.runtime.RuntimeConfig.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace


@dataclass
class ChildSpec:
    rank: int
    socket_dir: str  # the parent's socket directory: the command socket lives here
    runtime: dict  # RuntimeConfig's fields, for this rank
    buffers: dict[str, list]  # name -> [fd, nbytes, shape, dtype] (l3worker.worker.shared_buffers.BufferSpec)
    parent_pid: int = field(default_factory=os.getpid)
    wake_every_step: bool = False  # send a wake-up after every step, not only to a sleeping parent
    wake_fd: int | None = None  # an eventfd the leader writes after every step, instead of wake-up messages
    cpu_cores: list[int] | None = None  # a cpu child's threads run here only
    service_cores: list[int] | None = None  # and its socket threads here
    # Under every_core (fixed, or chosen by the trial): the core the step thread gets to itself
    # (chip_child.device.pin_step_thread); cpu_cores then holds every core.
    step_core: int | None = None
    # cpu_layout="auto": the layout the rule prefers, which the threads and pins above set up,
    # and chip_child.cpu_layout.LayoutCores' fields; the child times both layouts and keeps one
    layout_trial: dict | None = None
    fault: str | None = None  # test-only: "[CALLABLE:]raise@N", "hang@N" or "exit@N"; CALLABLE "startup": at start-up
    overlap_steps: bool | None = None  # launch a step before completing the last; None: on accelerators
    generation: int = 0  # how many times the parent restarted its children before this start

    @property
    def socket_path(self) -> str:
        # A restarted child gets a path of its own: the old socket's file is unlinked as it closes,
        # which must not remove the new one's.
        suffix = f"-{self.generation}" if self.generation else ""
        return os.path.join(self.socket_dir, f"chip{self.rank}{suffix}.sock")

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def fds(self) -> list[int]:
        """The shared buffers' descriptors and the wake-up eventfd: the child must inherit these."""
        return [fd for fd, *_ in self.buffers.values()] + ([self.wake_fd] if self.wake_fd is not None else [])

    def renumbered(self, new: dict[int, int]) -> "ChildSpec":
        """This spec with each of `fds` replaced by new[fd]: the number it arrived as in another
        process (chip_child/spec_handover.py)."""
        return replace(self, buffers={name: [new[fd], *rest] for name, (fd, *rest) in self.buffers.items()},
                       wake_fd=new[self.wake_fd] if self.wake_fd is not None else None)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ChildSpec":
        return cls(**json.loads(text))
