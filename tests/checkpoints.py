"""Tiny random checkpoints written by transformers, for the fixtures and for tests that write
their own (a module of its own: `conftest` names more than one file in this tree)."""
from __future__ import annotations

from pathlib import Path

import torch

# family -> transformers' config and model class names
FAMILIES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def write_hf_checkpoint(path: Path, seed: int = 0, family: str = "qwen3", **overrides) -> Path:
    """A random checkpoint of `family` saved with save_pretrained; returns the directory. A key
    overridden with `...` is left to the config class's default."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    kwargs = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                  max_position_embeddings=512, eos_token_id=None)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{k: v for k, v in kwargs.items() if v is not ...})).eval()
    model.save_pretrained(path)
    return path
