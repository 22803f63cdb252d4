"""Sleep and wake: the KV cache's and the weights' memory given back to the device while the
child, its pool and every tensor object stay (vLLM's sleep mode, for RL rollouts between
training steps).

Memory is freed by shrinking each tensor's storage to nothing and given back by growing it again,
so every view (the attention backend's per-layer cache views, a tied lm_head, the decode lanes)
still points at the right storage after a wake. On an accelerator the storage comes back at
another address, so captured decode graphs are captured again on wake (with every row idle, as at
start-up); the cpu has no graphs. A prepacked (oneDNN) matrix has no storage to shrink: level 2
swaps its buffer for an empty one, and the next weight update packs a new one.

Level 1 keeps the weights' values on the host (the cpu's weights are host memory already: they
stay); level 2 drops them, and the weights must be updated before the next request.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from chip_child.models.prepack import PackedLinear
from chip_child.models.qwen3 import Qwen3Weights

TAGS = ("weights", "kv_cache")
# Qwen3Weights' norm constants: no checkpoint tensor brings them back after level 2, and they are bytes.
CONSTANTS = ("eps", "inv_hidden", "inv_head_dim")


def device_bytes(device: torch.device) -> int:
    """What the device holds now: on the cpu the process's resident memory, elsewhere the
    allocator's bytes."""
    if device.type == "cpu":
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(getattr(torch, device.type).memory_allocated(device))


def weight_fields(obj: object) -> Iterator[tuple[object, str | int, torch.Tensor | PackedLinear]]:
    """(owner, attribute or list index, value) of every tensor and prepacked matrix under `obj`
    (the weights), through nested objects and lists, the norm constants left out."""
    items = enumerate(obj) if isinstance(obj, (list, tuple)) else vars(obj).items()
    for key, value in items:
        if key in CONSTANTS or value is None:
            continue
        if isinstance(value, (torch.Tensor, PackedLinear)):
            yield obj, key, value
        elif isinstance(value, (list, tuple)) or hasattr(value, "__dict__") and not isinstance(
                value, (type, torch.dtype)):
            yield from weight_fields(value)


def weight_leaves(weights: Qwen3Weights) -> tuple[list[torch.UntypedStorage], list[PackedLinear]]:
    """The distinct storages under the weights, and the prepacked matrices (which have none)."""
    storages: dict[int, torch.UntypedStorage] = {}
    packed: list[PackedLinear] = []
    for _, _, value in weight_fields(weights):
        if isinstance(value, PackedLinear):
            packed.append(value)
        else:
            storage = value.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values()), packed


def owned_storage(weights: Qwen3Weights) -> None:
    """Makes every weight's storage resizable (tensors read from safetensors are not), so sleep
    can free them in place: with sleep mode on, once at load."""
    for owner, key, value in list(weight_fields(weights)):
        if isinstance(value, torch.Tensor) and not value.untyped_storage().resizable():
            copy = value.clone(memory_format=torch.preserve_format)
            if isinstance(owner, list):
                owner[key] = copy
            else:
                setattr(owner, key, copy)
    if weights.tied and isinstance(weights.lm_head, torch.Tensor):
        weights.lm_head = weights.embed.t()  # a view of the embedding again


@dataclass
class SleepState:
    level: int = 0  # 0: awake
    kv_asleep: bool = False
    weights_asleep: bool = False
    weights_need_update: bool = False  # level 2 dropped them: an update must come before a request
    host_copies: list[torch.Tensor] = field(default_factory=list)  # level 1 off the cpu: per weight storage


class Sleeper:
    """Frees and restores one runtime's KV cache and weights."""

    def __init__(self, kv_cache: torch.Tensor, weights: Qwen3Weights, device: torch.device):
        self.kv_cache, self.weights, self.device = kv_cache, weights, device
        self.state = SleepState()
        self._kv = kv_cache.untyped_storage()
        self._kv_bytes = 0
        self._storages: list[tuple[torch.UntypedStorage, int]] = []  # freed weight storages, their sizes
        self._packed: list[PackedLinear] = []

    @property
    def asleep(self) -> bool:
        return self.state.level > 0

    def sleep(self, level: int) -> dict:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        st, before = self.state, device_bytes(self.device)
        if not st.kv_asleep:
            self._kv_bytes = self._kv.nbytes()
            self._kv.resize_(0)
            st.kv_asleep = True
        if level == 2 and st.host_copies:  # asleep at level 1 already: the host copies go too
            st.host_copies.clear()
            st.weights_need_update = True
        if not st.weights_asleep and (level == 2 or self.device.type != "cpu"):
            storages, self._packed = weight_leaves(self.weights)
            self._storages = [(storage, storage.nbytes()) for storage in storages]
            for storage, _ in self._storages:
                if level == 1:  # back to the host, then freed on the device
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(_bytes(storage))
                    st.host_copies.append(host)
                storage.resize_(0)
            if level == 2:
                for p in self._packed:
                    p.weight = torch.empty(0, dtype=p.weight.dtype)
                st.weights_need_update = True
            st.weights_asleep = True
        st.level = max(st.level, level)
        return {"level": st.level, "freed_bytes": before - device_bytes(self.device)}

    def wake_up(self, tags: list[str] | None) -> dict:
        """Gives the memory back (both tags when None). `moved`: device addresses changed, so
        captured graphs must be captured again."""
        tags = list(TAGS) if not tags else tags
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"tags: unknown {unknown}; known: {list(TAGS)}")
        st, before = self.state, device_bytes(self.device)
        moved = False
        if "weights" in tags and st.weights_asleep:
            for storage, nbytes in self._storages:
                storage.resize_(nbytes)
            for (storage, _), host in zip(self._storages, st.host_copies):
                _bytes(storage).copy_(host)
            st.host_copies.clear()
            st.weights_asleep, moved = False, bool(self._storages)
            self._storages = []
        if "kv_cache" in tags and st.kv_asleep:
            self._kv.resize_(self._kv_bytes)
            self.kv_cache.zero_()  # what was there is gone: no NaN from old bytes may reach a masked product
            st.kv_asleep, moved = False, True
        if not st.kv_asleep and not st.weights_asleep:
            st.level = 0
        return {"level": st.level, "restored_bytes": device_bytes(self.device) - before,
                "weights_need_update": st.weights_need_update, "moved": moved and self.device.type != "cpu"}

    def weights_updated(self) -> None:
        self.state.weights_need_update = False


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
