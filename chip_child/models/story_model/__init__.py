"""The built-in story model: a Qwen3 of about 0.6M parameters trained on children's stories that
scripts/train_story_model.py generates from a grammar, with a byte-level BPE tokenizer. The
example runs it when no checkpoint is given, so a first run prints words, not byte noise."""
from __future__ import annotations

from pathlib import Path

STORY_MODEL_NAME = "l3worker-stories"
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def story_model_dir() -> Path:
    """The directory of the shipped checkpoint (inside the installed package)."""
    here = Path(__file__).resolve().parent
    missing = [f for f in _FILES if not (here / f).is_file()]
    if missing:
        raise FileNotFoundError(f"the built-in story model is incomplete ({', '.join(missing)} missing in {here}); "
                                "reinstall the package or run scripts/train_story_model.py")
    return here
