"""What a user passes in and gets back."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None  # None draws one per request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError/TypeError naming the field and its limit."""
        _int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _real("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k)
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}] (0 disables), got {self.top_k}")
        if self.seed is not None:
            _int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for t in self.stop_token_ids:
            _int("stop_token_ids entry", t)
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} outside [0, {vocab_size})")


def _int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _real(name: str, value: object) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


@dataclass
class RequestMetrics:
    ttft_s: float  # from generate() being called to the first token reaching the parent
    decode_s: float  # first token to last token
    tpot_s: float  # decode_s / (tokens - 1); 0 for a single token
    queued_s: float  # time spent waiting for a free row


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" or "length"
    metrics: RequestMetrics | None = field(default=None)
