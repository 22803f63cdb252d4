"""Where a model's files are: a local directory, or a Hugging Face Hub id fetched into the hub cache.

Hub ids are resolved by huggingface_hub itself, so its environment applies unchanged: `HF_HOME`
(or `HF_HUB_CACHE`) picks the cache, `HF_HUB_OFFLINE=1` answers from the cache alone, `HF_TOKEN`
authenticates, and its progress bars show the download. Only what the runtime reads is fetched:
the config, the safetensors shards and their index, the tokenizer and the generation config.
"""
from __future__ import annotations

import os
from pathlib import Path

# What the loader, the tokenizer and the chat template read; nothing else of a repository is fetched.
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name`: no path separators beyond the one slash, no leading dot or slash."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") for p in parts) and "\\" not in name


def resolve_model(model: str | os.PathLike, revision: str | None = None, download_dir: str | None = None,
                  what: str = "model") -> str:
    """A local directory holding the model's files: `model` itself when it is a directory, else
    the snapshot of the Hub repository `model` names (downloaded into `download_dir` or the hub
    cache unless already there). Raises ValueError naming `what` when neither works."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision: {revision!r} was given, but {what} {str(model)!r} is a local directory")
        return str(path)
    name = str(model)
    if not looks_like_hub_id(name):
        raise ValueError(f"{what}: {name!r} is neither a directory nor a Hugging Face Hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id=name, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(MODEL_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ValueError(f"{what}: {name!r} is not a local directory, and the Hugging Face Hub could not supply "
                         f"it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
