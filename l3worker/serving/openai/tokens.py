"""The checkpoint's tokenizer as the API needs it: prompts to ids, ids back to text, and each token's
own text and raw bytes for logprobs."""
from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders


def _byte_level_chars() -> dict[str, int]:
    """The character byte-level BPE (GPT-2, Qwen) writes for each byte value, reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    table: dict[str, int] = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class Tokens:
    """Wraps a `tokenizers.Tokenizer`; every call is cheap enough for the event loop at prompt sizes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._chars = _byte_level_chars()
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text in the prompt (such as <|im_start|>) becomes its id, as in the engine."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for: part of a UTF-8 character for some byte-level tokens."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._chars for c in piece):
            return bytes(self._chars[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def _token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def token_text_without_tokenizer(token_id: int) -> str:
    """vLLM's spelling of a token when no tokenizer is loaded."""
    return f"token_id:{token_id}"
