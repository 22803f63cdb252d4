"""LoRA adapters on DistributedWorker (vLLM's add_lora / remove_lora / list_loras): registering
one reads and checks its PEFT checkpoint at once (l3worker.lora.peft_adapter), so a bad adapter is
a ValueError naming what is wrong before any request uses it. Requests name adapters with a
LoRARequest (generate(..., lora_request=...)); one never registered is registered then."""
from __future__ import annotations

from chip_child.models.loader import ModelConfig
from l3worker.lora.registry import LoraRegistry, as_request
from l3worker.lora.request import LoRARequest
from l3worker.worker.arg_checks import positive_int


def lora_registry(enable_lora: bool, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                  cfg: ModelConfig, speculative: bool, nnodes: int) -> LoraRegistry | None:
    """The worker's adapter book when `enable_lora`, its arguments checked by name."""
    if not isinstance(enable_lora, bool):
        raise TypeError(f"enable_lora must be a bool, got {type(enable_lora).__name__}")
    if not enable_lora:
        return None
    positive_int("max_loras", max_loras)
    positive_int("max_lora_rank", max_lora_rank)
    if max_cpu_loras is not None:
        positive_int("max_cpu_loras", max_cpu_loras)
    if speculative:
        raise ValueError("enable_lora cannot be combined with speculative_config yet: drafts and the verify step "
                         "run without the adapters")
    if nnodes > 1:
        raise ValueError("enable_lora runs on one node: the adapters reach the chip-children through this node's "
                         "shared memory (nnodes must be 1)")
    return LoraRegistry(cfg, max_loras, max_lora_rank, max_cpu_loras)


class LoraControls:
    """Mixed into DistributedWorker, whose `loras` is the LoraRegistry (None: LoRA off)."""

    loras: LoraRegistry | None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers an adapter; False when its lora_int_id is registered already."""
        return self._lora_book("add_lora").add(as_request(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Unregisters an adapter (rows running with it finish with it); False when unknown."""
        return self._lora_book("remove_lora").remove(lora_id)

    def list_loras(self) -> set[int]:
        return set(self._lora_book("list_loras").ids())

    def _lora_book(self, what: str) -> LoraRegistry:
        if self.loras is None:
            raise ValueError(f"{what}: LoRA adapters need enable_lora=True (--enable-lora)")
        return self.loras


def lora_info(engine) -> tuple[int, list[str], list[str]]:
    """For the lora_requests_info metric: max_loras, and the adapters of running and waiting sequences."""
    scheduler = engine.scheduler
    running = {s.lora.request.lora_name for s in (scheduler.running.values() if scheduler else ()) if s.lora}
    waiting = {s.lora.request.lora_name for s in (list(scheduler.waiting) if scheduler else ()) if s.lora}
    return engine.loras.max_loras, sorted(running), sorted(waiting)
