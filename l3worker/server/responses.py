"""Engine outputs in OpenAI's shapes: ids, usage, and the two logprobs formats."""
from __future__ import annotations

import json
import time
import uuid
from typing import Iterable

from l3worker.params import TokenLogprob
from l3worker.server.tokens import Tokens, token_text_without_tokenizer

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM's stand-in for an impossible token


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj: dict) -> str:
    """One server-sent event as OpenAI frames it."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps nan


class TokenFormatter:
    """Token text and bytes for logprobs, with or without a tokenizer."""

    def __init__(self, tokens: Tokens | None):
        self.tokens = tokens

    def text(self, token_id: int) -> str:
        return self.tokens.token_text(token_id) if self.tokens else token_text_without_tokenizer(token_id)

    def bytes(self, token_id: int) -> list[int]:
        raw = self.tokens.token_bytes(token_id) if self.tokens else self.text(token_id).encode()
        return list(raw)

    def decode(self, ids: list[int]) -> str:
        return self.tokens.decode(ids) if self.tokens else ""

    # -- /v1/completions: {tokens, token_logprobs, top_logprobs, text_offset} -----------------------
    def completion_logprobs(self, entries: Iterable[tuple[int, TokenLogprob | None]], offset: int) -> tuple[dict, int]:
        """`entries`: (token id, its logprobs or None for a prompt's first token). top_logprobs holds the
        top N and the chosen token, as OpenAI's does. Returns the object and the next text offset."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, lp in entries:
            text = self.text(token_id)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_lp(lp.logprob))
            # Keyed by text, as OpenAI's: the chosen token's own value wins, then the likelier of
            # two tokens that read the same (partial UTF-8 bytes all read as U+FFFD).
            top = {text: _lp(lp.logprob)}
            for t, v in lp.top:
                top.setdefault(self.text(t), _lp(v))
            top_logprobs.append(top)
        return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                 "text_offset": text_offset}, offset)

    # -- /v1/chat/completions: {content: [{token, logprob, bytes, top_logprobs}]} ------------------
    def chat_logprobs(self, logprobs: Iterable[TokenLogprob], top_n: int) -> dict:
        content = []
        for lp in logprobs:
            content.append({
                "token": self.text(lp.token_id), "logprob": _lp(lp.logprob), "bytes": self.bytes(lp.token_id),
                "top_logprobs": [{"token": self.text(t), "logprob": _lp(v), "bytes": self.bytes(t)}
                                 for t, v in lp.top[:top_n]],
            })
        return {"content": content, "refusal": None}
