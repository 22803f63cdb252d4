"""A Hugging Face Hub cache laid out as huggingface_hub lays it out, holding the built-in model:
what the Hub-id tests resolve offline."""
from __future__ import annotations

import shutil
from pathlib import Path

from chip_child.models.tiny_model import ensure_tiny_model

REPO = "l3test/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(hub_cache: Path, repo: str = REPO, commit: str = COMMIT, ref: str = "main") -> Path:
    """The built-in tiny model as huggingface_hub caches a snapshot: models--org--name/refs/<ref>
    holds the commit, snapshots/<commit>/ the files. Returns the snapshot directory."""
    storage = hub_cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(ensure_tiny_model(), snapshot)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot
