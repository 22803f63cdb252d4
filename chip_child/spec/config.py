"""Speculative decoding's configuration, with vLLM's keys: parsed and checked before any child starts.

Torch-free: the parent validates it, and it travels to the child as a plain dict inside
RuntimeConfig (`speculative`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from chip_child.config import config_fields

METHODS = ("ngram", "draft_model", "eagle3")  # the methods this build verifies; others are refused by name
PLANNED = ("eagle", "mtp")  # vLLM's other method names: refused as not supported yet
MAX_SPECULATIVE_TOKENS = 16  # drafts per row and step: the verify chunk is k + 1 tokens a row
MAX_LOOKUP = 64  # the longest n-gram the lookup matches


@dataclass(frozen=True)
class SpeculativeConfig:
    """`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b}`: each step, a speculating row proposes the k tokens that followed
    the latest earlier occurrence of its last n tokens (n from b down to a), and one forward
    verifies them. As in vLLM, a lookup bound left out takes the other's value (both out: 5).

    `{"method": "draft_model", "model": DIR, "num_speculative_tokens": k}`: a checkpoint with the
    target's vocabulary, run in the same child, proposes k tokens per row and step.

    `{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}`: an EAGLE-3 head
    (chip_child.spec.eagle3) drafts k tokens per row from the target's hidden states."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model, eagle3: the draft checkpoint's or head's directory

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            hint = " (not supported yet)" if self.method in PLANNED else ""
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}{hint}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            self._check_lookup()
            if self.model is not None:
                raise ValueError(f"speculative_config: method 'ngram' takes no model, got {self.model!r}")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config: method {self.method!r} needs 'model' (a checkpoint directory)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name} applies to method 'ngram' only")

    def _check_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (low if low is not None else high if high is not None else 5,
                     high if high is not None else low if low is not None else 5)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LOOKUP:
                raise ValueError(f"speculative_config: {name} must be an int in [1, {MAX_LOOKUP}], got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict[str, Any] | str") -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict, or a JSON object's text; ValueError names the problem."""
        if isinstance(value, cls):
            return value
        value = config_fields(value, cls, "speculative_config")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config: {key!r} is required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
