"""Pooled device tensors keyed by (callable, argument slot, shape, dtype)."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Literal

import torch

PoolKey = tuple[str, str, tuple[int, ...], torch.dtype]
Role = Literal["in", "out", "inout"]
# Host tensors from this size up (the KV cache) come zeroed from an anonymous mapping: the OS
# fills each page with zeros at its first touch, so start-up does not write gigabytes of zeros
# (a 7 GiB cache sized by gpu_memory_utilization took seconds to clear on the CI machine).
LAZY_ZERO_BYTES = 64 << 20


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A cpu tensor of zeros on a private anonymous mapping of its own (freed with the tensor),
    and the mapping; its storage cannot be resized."""
    buf = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape), buf


@dataclass(frozen=True)
class TaskArg:
    """One argument of a registered callable: which pooled tensor it names and how the step uses it.

    `owner` names the pool namespace; tensors that several callables share (the KV cache, the
    decode state that prefill seeds) live under a common owner instead of the callable's name.
    """

    slot: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    owner: str | None = None


class TensorPool:
    """Allocates each tensor once and hands the same storage back for every later step.

    `allocations` counts misses; after warm-up a decode step must not add to it. `resizable`:
    every storage can be resized (sleep mode frees the KV cache that way), so none is lazily zeroed.
    """

    def __init__(self, device: torch.device, resizable: bool = False):
        self.device = device
        self.lazy_zero = device.type == "cpu" and not resizable
        self._mappings: dict[int, mmap.mmap] = {}  # a lazily zeroed tensor's address -> its mapping
        self._tensors: dict[PoolKey, torch.Tensor] = {}
        self._resolved: dict[str, tuple[tuple[TaskArg, ...], dict[str, torch.Tensor]]] = {}
        self.allocations = 0

    def get(self, owner: str, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (owner, slot, tuple(shape), dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            if self.lazy_zero and math.prod(shape) * dtype.itemsize >= LAZY_ZERO_BYTES:
                tensor, buf = lazily_zeroed(tuple(shape), dtype)
                self._mappings[tensor.data_ptr()] = buf
            else:
                tensor = torch.zeros(shape, dtype=dtype, device=self.device)
            self._tensors[key] = tensor
            self.allocations += 1
        return tensor

    def resolve(self, callable_name: str, args: tuple[TaskArg, ...]) -> dict[str, torch.Tensor]:
        """The tensors `args` name, by slot. Each step of a callable passes the same argument
        tuple, so the last answer per callable is kept and reused while the tuple is the same."""
        hit = self._resolved.get(callable_name)
        if hit is not None and hit[0] is args:
            return hit[1]
        tensors = {a.slot: self.get(a.owner or callable_name, a.slot, a.shape, a.dtype) for a in args}
        self._resolved[callable_name] = (args, tensors)
        return tensors

    def zero(self, tensor: torch.Tensor) -> None:
        """Zeroes a pooled tensor: a lazily zeroed one by handing its written pages back to the
        OS (MADV_DONTNEED; they read as zeros again), so clearing a cache of gigabytes costs
        what was written, not its size."""
        buf = self._mappings.get(tensor.data_ptr())
        if buf is not None and tensor.numel() * tensor.element_size() == len(buf):
            buf.madvise(mmap.MADV_DONTNEED)
        else:
            tensor.zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def release(self) -> None:
        self._tensors.clear()
        self._mappings.clear()
        self._resolved.clear()
