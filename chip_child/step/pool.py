"""Pooled device tensors keyed by (callable, argument slot, shape, dtype)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PoolKey = tuple[str, str, tuple[int, ...], torch.dtype]
Role = Literal["in", "out", "inout"]


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

    `allocations` counts misses; after warm-up a decode step must not add to it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._tensors: dict[PoolKey, torch.Tensor] = {}
        self._resolved: dict[str, tuple[tuple[TaskArg, ...], dict[str, torch.Tensor]]] = {}
        self.allocations = 0

    def get(self, owner: str, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (owner, slot, tuple(shape), dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def release(self) -> None:
        self._tensors.clear()
        self._resolved.clear()
