"""The LoRA adapters an API server serves, by the names requests give as their "model"
(--lora-modules at start, then those loaded at run time: l3worker/serving/openai/lora_routes.py)."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from l3worker.lora import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


@dataclass
class ServedAdapters:
    """The adapters this API server serves, by name (--lora-modules, then loaded at run time)."""

    by_name: dict[str, LoRARequest] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, modules: tuple) -> "ServedAdapters":
        """From --lora-modules' (name, path, base_model_name) triples; ids count from 1."""
        return cls({name: LoRARequest(name, i + 1, path, base) for i, (name, path, base) in enumerate(modules)})

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)

    def next_id(self) -> int:
        with self._lock:
            return max((r.lora_int_id for r in self.by_name.values()), default=0) + 1
