"""Random Qwen3 checkpoints for the benchmarks (imported by the scripts next to this file)."""
from __future__ import annotations

from pathlib import Path


def write_random_qwen3(path: Path, config: dict, seed: int = 0) -> int:
    """A random Qwen3ForCausalLM of these Qwen3Config fields, seeded, saved with save_pretrained;
    returns its parameter count."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())
