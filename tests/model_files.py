"""Hand-made checkpoint files for loader and refusal tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_config(path: Path, **overrides: Any) -> Path:
    """Write a hand-made old-style (transformers 4) Qwen3 config.json."""
    raw: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
        "eos_token_id": 7,
    }
    raw.update(overrides)
    raw = {k: v for k, v in raw.items() if v is not ...}  # `...` deletes a key
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path
