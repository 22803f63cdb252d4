"""What a user passes in and gets back."""
from __future__ import annotations

import functools
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chip_child.step.row_fields import MAX_LOGPROBS, uses_penalties

if TYPE_CHECKING:
    from l3worker.structured.specs import StructuredSpec
# Tokens per step (at least max_batch_size): decode rows plus prefill chunks. Larger steps prefill
# faster: on the CI machine's cpu whole generates of 16 ~100-token prompts took 9-13% less time
# than with 256 (scripts/bench_cpu.py). Served, the step loop also caps by time the prompt tokens
# of a step that has decoding rows (l3worker/engine/step_timing.py), so a long prompt no longer
# needs a short budget to keep the running rows' inter-token latency low.
DEFAULT_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one constraint (json schema, regex, choice, grammar
    or json_object), given as `SamplingParams(structured_outputs=StructuredOutputsParams(...))`.
    `disable_any_whitespace` writes JSON with no blank between items; `disable_additional_properties`
    makes every object schema that lists its properties without saying `additionalProperties` allow
    no others (vLLM's guidance backend's rule); `whitespace_pattern` and `structural_tag` are refused."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in (*_SO_CONSTRAINTS, "structural_tag") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(_SO_CONSTRAINTS)}, got "
                             f"{', '.join(given) or 'none'}")
        for name, neutral in (("structural_tag", None), ("whitespace_pattern", None)):
            if getattr(self, name) != neutral:
                raise ValueError(f"structured_outputs.{name} is not supported by l3worker")

    def as_request(self) -> dict[str, Any]:
        """The constraint as vLLM's request body writes it ({"json": schema}, ...): what
        l3worker.structured.specs.StructuredSpec reads."""
        kind = next(k for k in _SO_CONSTRAINTS if getattr(self, k) is not None)
        value = getattr(self, kind)
        rewrite = self.disable_any_whitespace or self.disable_additional_properties
        if kind not in ("json", "json_object") or not rewrite:
            return {kind: value}
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if self.disable_additional_properties:
            schema = _closed_objects(schema)
        if self.disable_any_whitespace and isinstance(schema, dict):  # the schema's own x-guidance options win
            schema = {**schema, "x-guidance": {**_COMPACT_JSON, **schema.get("x-guidance", {})}}
        return {"json": schema}


def _closed_objects(node: Any) -> Any:
    """The schema with `additionalProperties: false` on each object that lists properties and says nothing of others."""
    if isinstance(node, list):
        return [_closed_objects(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: the names are not schema keywords
            out[key] = {name: _closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _SCHEMA_DATA else _closed_objects(value)
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_DATA = ("enum", "const", "default", "examples")
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling and stopping, with vLLM's names, defaults and semantics where one exists
    (`max_tokens=16`, `temperature=1.0`; `max_new_tokens` is accepted as a keyword and readable as
    an alias of `max_tokens`). `max_tokens=None` generates until the sequence fills max_seq_len.
    `top_k=-1` is vLLM's other spelling of 0 (disabled) and `seed=-1` of None. vLLM fields that
    l3worker does not implement are accepted at their neutral value (`detokenize=True`,
    `logit_bias=None`, ...) and refused by name otherwise.

    Penalties act on the logits before temperature: `repetition_penalty` over prompt and output
    tokens (a seen token's logit is divided by it when positive, multiplied when negative),
    `frequency_penalty` and `presence_penalty` over output tokens only (subtracted per occurrence
    and once per seen token). `min_p` drops tokens whose probability, after temperature, is below
    min_p times the most likely token's. `logprobs=N` reports the sampled token's log-probability
    and the top N from that same distribution (after penalties and temperature); `prompt_logprobs=N`
    the log-probability of every prompt token after the first (raw logits).

    `structured_outputs` holds the output to a constraint: a StructuredOutputsParams, a
    l3worker.structured.specs.StructuredSpec, or a dict of vLLM's keys (`{"json": schema}`,
    `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ebnf}`, `{"json_object": True}`). Disallowed
    tokens are masked before sampling (so `logprobs` are those of the constrained distribution), and
    the sample finishes with "stop" once its grammar is complete and allows nothing more. With a
    reasoning model, `reasoning_end_token_id` (`</think>`'s id) makes it apply only after that token
    is generated."""

    max_tokens: int | None = 16  # 0 only scores the prompt (with prompt_logprobs)
    temperature: float = 1.0  # 0 is greedy
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
    structured_outputs: StructuredSpec | StructuredOutputsParams | dict[str, Any] | None = None
    reasoning_end_token_id: int | None = None  # the constraint applies after this token (None: from the start)
    # scheduling_policy="priority": lower runs first (vLLM's request priority); must be 0 under "fcfs"
    priority: int = 0
    # vLLM's: a streamed delta holds this many new tokens, the first and last excepted (the engine's
    # stream_interval when that is larger; None: the engine's)
    stream_interval: int | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """l3worker's older name of max_tokens."""
        return self.max_tokens

    def __post_init__(self) -> None:
        # Users pass lists (vLLM: None for none); a frozen dataclass keeps them hashable and unshared.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                value = tuple(value)
            object.__setattr__(self, name, value)
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's older "disabled"
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        spec = self.structured_outputs
        if isinstance(spec, StructuredOutputsParams):
            spec = spec.as_request()
        if isinstance(spec, dict):  # checked here: ValueError naming the key
            from l3worker.structured.specs import StructuredSpec

            object.__setattr__(self, "structured_outputs", StructuredSpec.of(spec))

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError/TypeError naming the field and its limit."""
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens)
            if self.max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
            if self.max_tokens == 0 and self.prompt_logprobs is None:
                raise ValueError("max_tokens must be >= 1 (0 is only for scoring a prompt with prompt_logprobs)")
        _real("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k)
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}] (0 or -1 disables), got {self.top_k}")
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
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
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
        if self.stream_interval is not None:
            _int("stream_interval", self.stream_interval)
            if self.stream_interval < 1:
                raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        _int("priority", self.priority)
        if not -2**31 <= self.priority < 2**31:
            raise ValueError(f"priority must be in [-2**31, 2**31), got {self.priority}")
        if self.reasoning_end_token_id is not None:
            _int("reasoning_end_token_id", self.reasoning_end_token_id)
            if not 0 <= self.reasoning_end_token_id < vocab_size:
                raise ValueError(f"reasoning_end_token_id: {self.reasoning_end_token_id} outside [0, {vocab_size})")

    @property
    def uses_penalties(self) -> bool:
        return bool(uses_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty))


# vLLM SamplingParams fields with nothing behind them here: each accepted at the values that change
# nothing, so that code written for vLLM runs unchanged, and refused by name at any other.
_VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "detokenize": (True,), "spaces_between_special_tokens": (True,), "logits_processors": (None, []),
    "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "extra_args": (None, {}), "guided_decoding": (None,), "best_of": (None,),
    "thinking_token_budget": (None, -1), "flat_logprobs": (False,), "skip_clone": (False, True),
    "repetition_detection": (None,), "logprob_token_ids": (None,), "prompt_logprob_token_ids": (None,),
}
_MISSING: Any = object()


def _with_vllm_keywords(init):
    """The dataclass __init__, also taking `max_new_tokens` (max_tokens' older name) and vLLM's
    fields from _VLLM_NEUTRAL."""

    @functools.wraps(init)
    def __init__(self, *, max_new_tokens: int | None = _MISSING, **kwargs: Any) -> None:
        if max_new_tokens is not _MISSING:
            if "max_tokens" in kwargs:
                raise ValueError("give max_tokens or its alias max_new_tokens, not both")
            kwargs["max_tokens"] = max_new_tokens
        for name in [k for k in kwargs if k in _VLLM_NEUTRAL]:
            value = kwargs.pop(name)
            if not any(value is v or (type(value) is type(v) and value == v) for v in _VLLM_NEUTRAL[name]):
                raise ValueError(f"{name}={value!r} is not supported by l3worker (accepted: "
                                 f"{' or '.join(map(repr, _VLLM_NEUTRAL[name]))})")
        init(self, **kwargs)

    return __init__


SamplingParams.__init__ = _with_vllm_keywords(SamplingParams.__init__)  # type: ignore[method-assign]


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

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' log-probabilities; None unless `logprobs` was asked for."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


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
