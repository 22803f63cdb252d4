"""LoRA adapters (PEFT checkpoints) served beside the base model: the request that names one
(request.py), the checkpoint's reading and checks (peft_adapter.py), and the parent's book of
host copies and device slots (registry.py). The chip-child's side: chip_child/models/lora.py.
May import l3worker.engine's page pool and chip_child's loader, nothing that imports it back."""
from l3worker.lora.request import LoRARequest

__all__ = ["LoRARequest"]
