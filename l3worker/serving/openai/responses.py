"""Engine outputs in OpenAI's shapes: ids, usage, and the two logprobs formats."""
from __future__ import annotations

import json
import time
import uuid
from typing import Iterable

from l3worker.params import TokenLogprob
from l3worker.serving.openai.tokens import Tokens, token_text_without_tokenizer

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
    """Token text and bytes for logprobs, with or without a tokenizer. `as_ids`
    (return_tokens_as_token_ids) names every logprobs token "token_id:N", so that tokens whose text
    reads alike (partial UTF-8 bytes, all U+FFFD) stay apart; `bytes` stay the token's own."""

    def __init__(self, tokens: Tokens | None, as_ids: bool = False):
        self.tokens = tokens
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        """The token's text, for text offsets."""
        return self.tokens.token_text(token_id) if self.tokens else token_text_without_tokenizer(token_id)

    def name(self, token_id: int) -> str:
        """How a logprobs entry names the token."""
        return token_text_without_tokenizer(token_id) if self.as_ids else self.text(token_id)

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
            name = self.name(token_id)
            tokens.append(name)
            text_offset.append(offset)
            offset += len(self.text(token_id))
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_lp(lp.logprob))
            # Keyed by the token's name, as OpenAI's. Two tokens that read alike share a key, and the
            # likelier one's value is kept: the chosen token's own value would pass for the top one
            # (lm-eval's is_greedy compares it with the largest value). return_tokens_as_token_ids
            # keeps every token apart.
            top: dict[str, float] = {}
            for t, v in ((token_id, lp.logprob), *lp.top):
                key, value = self.name(t), _lp(v)
                top[key] = max(top.get(key, value), value)
            top_logprobs.append(top)
        return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                 "text_offset": text_offset}, offset)

    # -- /v1/chat/completions: {content: [{token, logprob, bytes, top_logprobs}]} ------------------
    def chat_logprobs(self, logprobs: Iterable[TokenLogprob], top_n: int) -> dict:
        content = []
        for lp in logprobs:
            content.append({
                "token": self.name(lp.token_id), "logprob": _lp(lp.logprob), "bytes": self.bytes(lp.token_id),
                "top_logprobs": [{"token": self.name(t), "logprob": _lp(v), "bytes": self.bytes(t)}
                                 for t, v in lp.top[:top_n]],
            })
        return {"content": content, "refusal": None}
