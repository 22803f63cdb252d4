"""LoRA adapters (PEFT checkpoints) served beside the base model: the request that names one, the
checkpoint's reading and checks, and the parent's book of host copies and device slots. Imports
l3worker.params and chip_child's torch-free modules only."""
from l3worker.lora.request import LoRARequest

__all__ = ["LoRARequest"]
