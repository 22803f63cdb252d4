"""Random PEFT LoRA adapters for the tiny test checkpoints, written by peft itself."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, out: Path, seed: int, r: int = 4, alpha: float = 8, targets=ALL_TARGETS,
                  scale: float = 0.3, **config) -> Path:
    """A LoRA adapter of `base` (a checkpoint folder) with random A and B (peft starts B at zero,
    which would make every adapter the base model), saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    model = _base(str(base))
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(str(out))
    peft_model.unload()  # the base model comes back unchanged for the next adapter
    return out


def peft_model(base: Path, adapter: Path):
    """transformers' model of `base` with `adapter` applied, fp32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model, str(adapter)).eval()


@lru_cache(maxsize=4)
def _base(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
