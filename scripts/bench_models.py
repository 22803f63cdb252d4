"""Random Qwen3 checkpoints for the benchmarks (imported by the scripts next to this file)."""
from __future__ import annotations

from pathlib import Path


def write_random_qwen3(path: Path, config: dict, seed: int = 0, family: str = "Qwen3") -> int:
    """A random {family}ForCausalLM (Qwen3 unless told, e.g. Qwen3Moe) of these {family}Config
    fields, seeded, saved with save_pretrained; returns its parameter count."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config_cls, model_cls = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")
    model = model_cls(config_cls(**config)).eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())
