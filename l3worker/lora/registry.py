"""The parent's book of adapters: the ones registered (by LoRARequest), their host copies (the
checked adapter written to a file in shared memory, at most `max_cpu_loras` kept, least recently
used first out and written again when needed), and which adapter each of the children's
`max_loras` device slots holds.

A sequence with an adapter takes a slot when it is admitted (`acquire`): the slot already holding
its adapter, else a free one, else the least recently used one that no running sequence holds;
none of those, and it waits. A new slot means one load (slot, file) sent to the children before
the command that admits it. Each registration has its own prefix-cache root (`root`), so pages
are never shared between adapters, or between an adapter and the base model.
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from chip_child.models.loader import ModelConfig
from l3worker.engine.page_pool import ROOT_HASH, hash_page
from l3worker.lora.peft_adapter import read_adapter, write_adapter
from l3worker.lora.request import LoRARequest


@dataclass
class Registered:
    request: LoRARequest
    rank: int
    root: int  # the prefix cache's chain root of this registration


class LoraRegistry:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        self.cfg = cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if self.max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras must be >= max_loras={max_loras}, got {self.max_cpu_loras}")
        self.adapters: dict[int, Registered] = {}
        self.slots: list[Registered | None] = [None] * max_loras  # the registration each device slot holds
        self.users = [0] * max_loras  # running sequences per slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._host: OrderedDict[int, Path] = OrderedDict()  # a registration's root -> its host copy
        self._generation = 0
        self._lock = threading.Lock()  # add/remove come from callers' threads, acquire from the loop's
        self._folder: Path | None = None  # made at the first host copy, removed by close()
        self.loads = 0  # adapter loads into device slots

    # -- registration (any thread) -------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Registers the adapter (read and checked now); False when its id is registered already."""
        with self._lock:
            known = self.adapters.get(request.lora_int_id)
            if known is not None:
                if known.request.lora_path != request.lora_path and request.lora_path:
                    raise ValueError(f"lora_int_id {request.lora_int_id} is registered already as "
                                     f"{known.request.lora_name!r} from {known.request.lora_path}")
                return False
        adapter = read_adapter(request.lora_path, self.cfg, self.max_lora_rank)
        with self._lock:
            self._generation += 1
            root = hash_page(ROOT_HASH, struct.pack("=qq", request.lora_int_id, self._generation))
            self.adapters[request.lora_int_id] = Registered(request, adapter.rank, root)
            self._store(root, adapter)
        return True

    def remove(self, adapter_id: int) -> bool:
        """Unregisters it; rows running with it finish with it. False when it is not registered."""
        with self._lock:
            gone = self.adapters.pop(adapter_id, None)
            if gone is None:
                return False
            for s, held in enumerate(self.slots):
                if held is gone and not self.users[s]:
                    self.slots[s] = None
            if gone not in self.slots:  # else a running row's slot may still load from it
                self._drop_host_copy(gone.root)
            return True

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self.adapters)

    def get(self, adapter_id: int) -> Registered | None:
        with self._lock:
            return self.adapters.get(adapter_id)

    def by_name(self, name: str) -> Registered | None:
        with self._lock:
            return next((r for r in self.adapters.values() if r.request.lora_name == name), None)

    # -- device slots (the step loop) ---------------------------------------------------------------
    def acquire(self, adapter: Registered) -> tuple[int, str | None] | None:
        """(slot, the host copy to load into it, None when it holds the adapter already), one user
        counted on it; None when every slot is held by running sequences of other adapters. A
        registration removed since its request arrived still runs (read again if need be)."""
        with self._lock:
            held = next((s for s, r in enumerate(self.slots) if r is adapter), None)
            if held is not None:
                slot, load = held, None
            else:
                slot = next((s for s in self._slot_lru if self.slots[s] is None), None)
                if slot is None:
                    slot = next((s for s in self._slot_lru if not self.users[s]), None)
                if slot is None:
                    return None
                self.slots[slot] = adapter
                load = str(self._host_copy(adapter))
                self.loads += 1
            self.users[slot] += 1
            self._slot_lru.move_to_end(slot)
            return slot, load

    def release(self, slot: int) -> None:
        with self._lock:
            self.users[slot] -= 1
            held = self.slots[slot]
            if not self.users[slot] and held is not None and self.adapters.get(held.request.lora_int_id) is not held:
                self.slots[slot] = None  # removed while it ran
                self._drop_host_copy(held.root)

    def reset_slots(self) -> None:
        """The children restarted: their slots are empty (users are counted again at re-admission)."""
        with self._lock:
            self.slots = [None] * self.max_loras
            self.users = [0] * self.max_loras

    def running(self) -> list[str]:
        with self._lock:
            return [r.request.lora_name for s, r in enumerate(self.slots) if r is not None and self.users[s]]

    def close(self) -> None:
        with self._lock:
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None
            self._host.clear()

    @property
    def folder(self) -> Path:
        """Where the host copies are: shared memory where there is some."""
        if self._folder is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._folder = Path(tempfile.mkdtemp(prefix=f"l3worker-lora-{os.getpid()}-", dir=base))
        return self._folder

    # -- host copies (under the lock) -----------------------------------------------------------------
    def _store(self, root: int, adapter) -> Path:
        path = self.folder / f"{root & 0xFFFFFFFFFFFFFFFF:016x}.safetensors"
        write_adapter(adapter, path)
        self._host[root] = path
        # The least recently used go first, never one a slot holds (a child may still be loading it).
        in_slots = {r.root for r in self.slots if r is not None}
        for old in [k for k in self._host if k not in in_slots and k != root][:max(0, len(self._host) -
                                                                                    self.max_cpu_loras)]:
            self._host.pop(old).unlink(missing_ok=True)
        return path

    def _drop_host_copy(self, root: int) -> None:
        path = self._host.pop(root, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def _host_copy(self, adapter: Registered) -> Path:
        path = self._host.get(adapter.root)
        if path is not None and path.exists():
            self._host.move_to_end(adapter.root)
            return path
        return self._store(adapter.root, read_adapter(adapter.request.lora_path, self.cfg, self.max_lora_rank))


def as_request(value: object) -> LoRARequest:
    if not isinstance(value, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest, got {type(value).__name__}")
    return value


def registration(loras: LoraRegistry | None, lora_request: object) -> Registered | None:
    """The registration a request runs with (registered now if it is new); None: the base model."""
    if lora_request is None:
        return None
    request = as_request(lora_request)
    if loras is None:
        raise ValueError("lora_request: LoRA adapters need enable_lora=True (--enable-lora)")
    known = loras.get(request.lora_int_id)
    if known is None:
        loras.add(request)
        known = loras.get(request.lora_int_id)
    return known
