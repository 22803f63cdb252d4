"""What a user passes in and gets back."""
from __future__ import annotations

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
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t!r} outside [0, {vocab_size})")


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
