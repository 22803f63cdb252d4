"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's
configuration, so that a client can tokenize and render chats as the server does (lm-eval's
tokenizer_backend=remote reads eos_token, bos_token and chat_template here, then calls /tokenize).

As vLLM answers: tokenizer_config.json's fields with special tokens as their text and file paths
left out, `tokenizer_class`, and `chat_template` the template the server renders (--chat-template
or the checkpoint's)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from l3worker.serving.openai.chat import ChatTemplate

_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")
_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _as_text(value: Any) -> Any:
    """A serialized AddedToken ({"content": ..., "special": ...}) as its text; anything else as is."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value


def tokenizer_info(model_dir: str | Path, chat_template: ChatTemplate | None) -> dict[str, Any]:
    path = Path(model_dir) / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        loaded = json.loads(path.read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    for name in _FILE_FIELDS:
        config.pop(name, None)
    for name in _TOKEN_FIELDS:
        config[name] = _as_text(config.get(name))  # present even when unset: clients test for eos_token
    if isinstance(config.get("added_tokens_decoder"), dict):
        config["added_tokens_decoder"] = {k: _as_text(v) for k, v in config["added_tokens_decoder"].items()}
    if isinstance(config.get("additional_special_tokens"), list):
        config["additional_special_tokens"] = [_as_text(v) for v in config["additional_special_tokens"]]
    config["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template.source
    return config
