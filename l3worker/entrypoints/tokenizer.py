"""What `LLM.get_tokenizer()` returns: the checkpoint's tokenizer.json and chat template behind the
methods vLLM users call on a transformers tokenizer, with transformers' defaults (encode adds special
tokens, decode keeps them, apply_chat_template tokenizes). transformers itself is not needed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from l3worker.serving.openai.chat import SPECIAL_TOKEN_NAMES, ChatTemplate


class LLMTokenizer:
    def __init__(self, tokenizer: Tokenizer, model_dir: str | Path):
        self.backend = tokenizer  # the tokenizers.Tokenizer
        self.name_or_path = str(model_dir)
        self._template = ChatTemplate.load(model_dir)
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self._special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}

    # -- text and ids --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ..., "attention_mask": ...} for one text or a list of them (no padding)."""
        ids = [self.encode(t, add_special_tokens) for t in text] if isinstance(text, list) \
            else self.encode(text, add_special_tokens)
        mask = [[1] * len(i) for i in ids] if isinstance(text, list) else [1] * len(ids)
        return {"input_ids": ids, "attention_mask": mask}

    def tokenize(self, text: str) -> list[str]:
        return self.backend.encode(text, add_special_tokens=False).tokens

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """transformers' meaning: the base vocabulary, added tokens not counted (len() counts them)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- special tokens ------------------------------------------------------------------------------
    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token(self) -> str | None:
        return self._special["pad_token"]

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted({i for t in self._special.values() if (i := self._id(t)) is not None})

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # -- chat ----------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self._template.source if self._template is not None else None

    def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
                            tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = False, return_tensors: str | None = None,
                            **kwargs: Any) -> str | list[int] | list[str] | list[list[int]]:
        """As transformers renders a chat: the messages as given, `kwargs` as template variables;
        token ids (special tokens not added again) unless tokenize=False. A list of conversations
        gives a list."""
        for name, value in (("return_dict", return_dict), ("return_tensors", return_tensors)):
            if value:
                raise ValueError(f"apply_chat_template: {name} is not supported by l3worker's tokenizer")
        template = self._template if chat_template is None else ChatTemplate.load(self.name_or_path, chat_template)
        if template is None:
            raise ValueError(f"{self.name_or_path} has no chat template (no chat_template.jinja, nor chat_template in "
                             "tokenizer_config.json); pass chat_template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        batched = bool(conversation) and isinstance(conversation[0], list)
        rendered = [self._render(template, c, tools, documents, add_generation_prompt, continue_final_message, kwargs)
                    for c in (conversation if batched else [conversation])]
        out = [self.encode(t, add_special_tokens=False) for t in rendered] if tokenize else rendered
        return out if batched else out[0]

    def _render(self, template: ChatTemplate, messages: list[dict[str, Any]], tools, documents,
                add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        text = template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                               documents=documents, **kwargs)
        if not continue_final_message or not messages:
            return text
        # transformers' rule: cut the chat right after the final message's content, so that the
        # model continues that message instead of closing it.
        final = messages[-1].get("content")
        final = final if isinstance(final, str) else ""
        for piece in (final, final.strip()):
            if piece and piece in text:
                return text[:text.rindex(piece) + len(piece)]
        raise ValueError("continue_final_message: the final message's content does not appear in the rendered chat")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
