"""What a user passes in and gets back."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chip_child.step.row_fields import MAX_LOGPROBS, uses_penalties

if TYPE_CHECKING:
    from l3worker.structured.specs import StructuredSpec
# Tokens per step (at least max_batch_size): decode rows plus prefill chunks. Offline (the worker's
# default) larger steps prefill faster: on the CI machine's cpu whole generates of 16 ~100-token
# prompts took 9-13% less time than with 256 (scripts/bench_cpu.py). Serving on a cpu
# (`l3worker serve`'s default there), a long prompt must delay the running rows' next token by one
# short chunk only: 256 kept their inter-token p99 at 83 ms through a 3,000-token prefill (512:
# 168 ms, the whole prompt in one step: 649 ms) for 12% more prefill time (scripts/bench_scheduler.py).
DEFAULT_BATCHED_TOKENS = 2048
SERVE_CPU_BATCHED_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping, with vLLM's names and semantics where one exists.

    Penalties act on the logits before temperature: `repetition_penalty` over prompt and output
    tokens (a seen token's logit is divided by it when positive, multiplied when negative),
    `frequency_penalty` and `presence_penalty` over output tokens only (subtracted per occurrence
    and once per seen token). `min_p` drops tokens whose probability, after temperature, is below
    min_p times the most likely token's. `logprobs=N` reports the sampled token's log-probability
    and the top N from that same distribution (after penalties and temperature); `prompt_logprobs=N`
    the log-probability of every prompt token after the first (raw logits).

    `structured_outputs` holds the output to a constraint: a l3worker.structured.specs.StructuredSpec,
    or a dict of vLLM's keys (`{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`,
    `{"grammar": ebnf}`, `{"json_object": True}`). Disallowed tokens are masked before sampling
    (so `logprobs` are those of the constrained distribution), and the sample finishes with
    "stop" once its grammar is complete and allows nothing more. With a reasoning model,
    `reasoning_end_token_id` (`</think>`'s id) makes it apply only after that token is generated."""

    max_new_tokens: int = 16  # 0 only scores the prompt (with prompt_logprobs)
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None  # None draws one per request
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens were generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N per generated token (0: the sampled token's only)
    prompt_logprobs: int | None = None
    n: int = 1  # samples of the prompt; sample i draws from seed + i
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredSpec | dict[str, Any] | None = None
    reasoning_end_token_id: int | None = None  # the constraint applies after this token (None: from the start)

    def __post_init__(self) -> None:
        # Users pass lists; a frozen dataclass keeps them hashable and unshared.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.structured_outputs, dict):  # checked here: ValueError naming the key
            from l3worker.structured.specs import StructuredSpec

            object.__setattr__(self, "structured_outputs", StructuredSpec.of(self.structured_outputs))

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError/TypeError naming the field and its limit."""
        _int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_new_tokens must be >= 1 (0 is only for scoring a prompt with prompt_logprobs)")
        _real("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k)
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}] (0 disables), got {self.top_k}")
        _real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a str or a list of str")
        if any(not s for s in self.stop):
            raise ValueError("stop: empty stop string")
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError("stop_token_ids must be a list of ints")
        for t in self.stop_token_ids:
            _int("stop_token_ids entry", t)
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {t} outside [0, {vocab_size})")
        _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _real(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _real("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2**16:
            raise ValueError(f"repetition_penalty must be in (0, 65536], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        _int("n", self.n)
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in [1, 64], got {self.n}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.structured_outputs is not None:
            from l3worker.structured.specs import StructuredSpec

            if not isinstance(self.structured_outputs, StructuredSpec):
                raise TypeError("structured_outputs must be a StructuredSpec or a dict, got "
                                f"{type(self.structured_outputs).__name__}")
        if self.reasoning_end_token_id is not None:
            _int("reasoning_end_token_id", self.reasoning_end_token_id)
            if not 0 <= self.reasoning_end_token_id < vocab_size:
                raise ValueError(f"reasoning_end_token_id: {self.reasoning_end_token_id} outside [0, {vocab_size})")

    @property
    def uses_penalties(self) -> bool:
        return bool(uses_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty))


def _int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _real(name: str, value: object) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the chosen token's and the top N, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestMetrics:
    ttft_s: float  # from the request's arrival to its first token reaching the parent
    decode_s: float  # first token to last token
    tpot_s: float  # decode_s / (tokens - 1); 0 for a single token
    queued_s: float  # time spent waiting for a free row


@dataclass
class CompletionOutput:
    """One sample of a request. A streamed output carries what is new in the `delta_*` fields;
    the cumulative fields (`text`, `token_ids`, `logprobs`) are filled in the final output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request: in streamed outputs, one entry in `outputs` per
    sample that advanced; in the final output (`finished`), every sample, cumulative."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the engine gave up on the request (running at two consecutive chip-child failures):
    # its samples end with finish_reason "abort" and what they had produced.
    error: str | None = None

    # The first sample's fields, for the common n=1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason
