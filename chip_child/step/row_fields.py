"""The per-row fields: one table from which everything that carries a row's options is derived.

A sequence's options reach the child in an Admit when it takes a row and, under
copy_policy="always", in every decode step's FullState; the child keeps them in pooled device
tensors and host copies (chip_child.step.row_state). `ROW_FIELDS` says, for each, its type, its
neutral value (an idle row's, and an admit's default), its limits and where it lives; `Admit`,
`FullState`, their wire form and checks (chip_child.protocol), the device scatter and the host
copies are all built from it. A new per-row option is one row here plus the code that uses it.

Torch-free: the parent builds admits and full states with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Iterable

import numpy as np

from chip_child.config import Limits
from chip_child.sampling.seeds import seed_key

MAX_LOGPROBS = 20  # top-N log-probabilities per token (OpenAI's limit)

NO_IDS = np.zeros(0, np.int32)
NO_IDS.flags.writeable = False

Bound = int | float | str | None  # a str names a Limits attribute; None: unbounded

_KINDS = {"float": float, "int": int, "ids": np.ndarray, "bytes": bytes}
MAX_GRAMMAR_BYTES = 1 << 20  # a row's grammar text: a JSON schema of a megabyte is far past any real one


@dataclass(frozen=True)
class RowField:
    """One per-row option. `kind` is "float" (finite), "int", "ids" (int32 token ids: bytes on
    the wire, [B, S] padded with -1 in a full state, no host copy) or "bytes" (opaque, at most
    MAX_GRAMMAR_BYTES, never in a full state, no host copy). Values lie within `low`/`high`,
    `ends` saying which of them are included."""

    name: str  # in Admit, chip_child.local.LocalRequest, and l3worker.params.SamplingParams where it has one
    dtype: type  # numpy dtype of its [B] arrays (of each id for "ids")
    neutral: Any  # the value of a row that does not use the option, and of an idle row
    kind: str = "float"
    low: Bound = None
    high: Bound = None
    ends: str = "[]"
    required: bool = False  # every admit gives it: the basic admit is the row and these
    array: str = ""  # its [B] array in FullState, the host copies and on the device; "": `name`
    full_state: bool = True  # carried by a full state (which never comes with a prefill)
    device: bool = False  # a pooled device tensor, the sampler's input
    key: Callable[[int], int] | None = None  # the value -> what its array holds (a seed -> its row key)
    example: Any = None  # a valid value that uses the option: warm-up runs every sampler stage with these

    def __post_init__(self) -> None:
        if not self.array:
            object.__setattr__(self, "array", self.name)

    def coerce(self, value: Any) -> Any:
        """The value as an Admit holds it (plain Python numbers: msgpack takes no numpy scalars)."""
        if self.kind == "ids":
            return np.asarray(value, np.int32)
        if self.kind == "bytes":
            return value.encode() if isinstance(value, str) else bytes(value)
        return _KINDS[self.kind](value)

    def to_array(self, value: Any) -> Any:
        return value if self.key is None else self.key(value)

    def bounds(self, limits: Limits) -> tuple[float, float]:
        def resolve(bound: Bound, unbounded: float) -> float:
            return unbounded if bound is None else getattr(limits, bound) if isinstance(bound, str) else bound

        return resolve(self.low, -math.inf), resolve(self.high, math.inf)

    def contains(self, value: Any, limits: Limits) -> Any:
        """Whether `value` (a number, or an array elementwise) lies within the limits."""
        if self.kind == "bytes":
            return len(value) <= MAX_GRAMMAR_BYTES
        low, high = self.bounds(limits)
        above = value >= low if self.ends[0] == "[" else value > low
        below = value <= high if self.ends[1] == "]" else value < high
        return above & below

    def interval(self, limits: Limits) -> str:
        low, high = self.bounds(limits)
        return f"{self.ends[0]}{low}, {high}{self.ends[1]}"


_EXAMPLE_IDS = np.array([0], np.int32)
_EXAMPLE_IDS.flags.writeable = False

ROW_FIELDS: tuple[RowField, ...] = (
    RowField("prompt_len", np.int64, 0, "int", 1, "max_seq_len", "[)", required=True, array="prompt_lens",
             example=2),
    RowField("temperature", np.float32, 0.0, required=True, device=True, example=1.0),
    RowField("top_p", np.float32, 1.0, required=True, device=True, example=0.9),
    RowField("top_k", np.int64, 0, "int", 0, 2**31, "[)", required=True, device=True, example=5),
    RowField("seed", np.int64, 0, "int", 0, 2**64, "[)", required=True, array="seed_keys", device=True, key=seed_key,
             example=7),
    RowField("min_p", np.float32, 0.0, low=0, high=1, device=True, example=0.1),
    RowField("presence_penalty", np.float32, 0.0, device=True, example=0.5),
    RowField("frequency_penalty", np.float32, 0.0, device=True, example=0.5),
    RowField("repetition_penalty", np.float32, 1.0, low=0, ends="(]", device=True, example=1.2),
    # Tokens the row generates at most (0: unbounded): a speculating row never drafts past them.
    RowField("max_new_tokens", np.int64, 0, "int", 0, "max_seq_len", full_state=False, example=8),
    RowField("min_tokens", np.int64, 0, "int", 0, "max_seq_len", example=2),  # stop_ids are masked until then
    RowField("stop_ids", np.int32, NO_IDS, "ids", example=_EXAMPLE_IDS),
    RowField("logprobs", np.int64, -1, "int", -1, MAX_LOGPROBS, example=MAX_LOGPROBS),  # -1: none; N: the top N too
    RowField("prompt_logprobs", np.int64, -1, "int", -1, MAX_LOGPROBS, full_state=False, example=MAX_LOGPROBS),
    # Structured outputs (chip_child.sampling.grammar): llguidance grammar text (b"": unconstrained), the
    # token after whose first sampling it applies (-1: from the first token; the reasoning
    # parser's </think>), and the tokens the row already produced (a resumed sequence's). The
    # child keeps the matcher: state like the KV cache, so a full state carries none of them.
    # The example allows any text, so warm-up runs the mask stage with any tokenizer (or none).
    RowField("grammar", np.uint8, b"", "bytes", full_state=False, example=b"start: /(?s:.*)/"),
    RowField("grammar_after", np.int64, -1, "int", -1, 2**31, "[)", full_state=False, example=0),
    RowField("grammar_replay", np.int32, NO_IDS, "ids", full_state=False, example=_EXAMPLE_IDS),
    # Speculative decoding: the ids of the leading positions the row's chunks skip (a prefix-cache
    # hit), for the child's per-row token history (chip_child.spec.speculation).
    RowField("cached_ids", np.int32, NO_IDS, "ids", full_state=False, example=_EXAMPLE_IDS),
    # The row's LoRA adapter slot (chip_child.models.lora), -1: the base model.
    RowField("lora_slot", np.int64, -1, "int", -1, "max_loras", "[)", device=True, example=0),
)
FIELDS_BY_NAME = {f.name: f for f in ROW_FIELDS}
SCALAR_FIELDS = tuple(f for f in ROW_FIELDS if f.kind not in ("ids", "bytes"))  # the ones with host copies
DEVICE_FIELDS = tuple(f for f in ROW_FIELDS if f.device)
FULL_STATE_FIELDS = tuple(f for f in ROW_FIELDS if f.full_state)
BASIC_FIELDS = tuple(f for f in ROW_FIELDS if f.required)
assert ROW_FIELDS[:len(BASIC_FIELDS)] == BASIC_FIELDS, "required fields come first: they have no default"


def uses_penalties(presence_penalty: Any, frequency_penalty: Any, repetition_penalty: Any) -> Any:
    """Whether a row's penalties change its logits (numbers, or arrays elementwise)."""
    return (presence_penalty != 0) | (frequency_penalty != 0) | (repetition_penalty != 1)


def example_values(required_only: bool = False) -> dict[str, Any]:
    """Every field's example value (but, when `required_only`, neutral ones for the optional)."""
    return {f.name: f.neutral if required_only and not f.required else f.example for f in ROW_FIELDS}


def row_values(source: object, **given: Any) -> dict[str, Any]:
    """Every per-row field's value for one sequence, as Admit holds it: `given`, else `source`'s
    attribute of that name (None there: the neutral value)."""
    unknown = given.keys() - FIELDS_BY_NAME.keys()
    if unknown:
        raise TypeError(f"not per-row fields: {sorted(unknown)}")
    values = {}
    for f in ROW_FIELDS:
        value = given[f.name] if f.name in given else getattr(source, f.name)
        values[f.name] = f.neutral if value is None else f.coerce(value)
    return values


def dataclass_fields(required: bool) -> list[tuple]:
    """make_dataclass specs of the per-row fields, with their neutral values as defaults but,
    when `required`, for the basic fields."""
    specs = []
    for f in ROW_FIELDS:
        if required and f.required:
            specs.append((f.name, _KINDS[f.kind]))
        else:
            neutral = f.neutral  # an array is unhashable: a dataclass wants a factory for it
            default = field(default_factory=lambda v=neutral: v) if f.kind == "ids" else field(default=neutral)
            specs.append((f.name, _KINDS[f.kind], default))
    return specs


Admit = make_dataclass("Admit", [("row", int), *dataclass_fields(required=True)], namespace={
    "__module__": __name__,
    "__doc__": """A sequence taking `row`: its per-row fields (ROW_FIELDS, in that order). Its pages
    arrive as triples and its prompt as chunks, in this command and later ones; the row decodes once
    its last chunk ran. Generated tokens start at `prompt_len` (a resumed sequence prefills some of
    them again): the last chunk's sampled token is generated token (its end - prompt_len), and a
    decode step whose input sits at position p samples generated token p - prompt_len + 1. While
    that index is below `min_tokens` the `stop_ids` (eos and stop token ids, as the parent decides)
    cannot be sampled. Penalties, min_p and log-probabilities follow l3worker.params.SamplingParams;
    the penalties count the row's chunk tokens (prompt below prompt_len, output from there), so a
    penalized sequence's chunks must cover it from position 0. `logprobs` and `prompt_logprobs` are
    -1 for none, else the number of top entries (0..MAX_LOGPROBS)."""})

# The decode inputs a full state carries beside the per-row fields.
FULL_STATE_BASE = (("positions", np.int64), ("active", np.bool_), ("block_table", np.int32),
                   ("slot_mapping", np.int64))


class _FullStateMethods:
    _FIELDS = FULL_STATE_BASE + tuple((f.array, f.dtype) for f in FULL_STATE_FIELDS)  # the wire order

    def __post_init__(self) -> None:
        if (self.positions is None) != (self.slot_mapping is None):
            raise ValueError("a full state gives positions and slot_mapping both or neither")
        b = len(self.active)
        for f in FULL_STATE_FIELDS:
            if getattr(self, f.array) is None:
                neutral = np.zeros((b, 0), f.dtype) if f.kind == "ids" else np.full(b, f.neutral, f.dtype)
                setattr(self, f.array, neutral)

    @classmethod
    def from_rows(cls, positions: np.ndarray | None, active: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray | None, rows: Iterable[tuple[int, dict[str, Any]]]) -> "FullState":
        """A full state whose listed rows hold their row_values() and every other row neutral ones."""
        rows = list(rows)
        b, index = len(active), np.array([r for r, _ in rows], np.int64)
        arrays = {}
        for f in FULL_STATE_FIELDS:
            if f.kind == "ids":  # each row's ids, padded with -1
                arr = np.full((b, max((len(v[f.name]) for _, v in rows), default=0)), -1, f.dtype)
                for r, v in rows:
                    arr[r, :len(v[f.name])] = v[f.name]
            else:
                arr = np.full(b, f.neutral, f.dtype)
                arr[index] = [f.to_array(v[f.name]) for _, v in rows]
            arrays[f.array] = arr
        return cls(positions, active, block_table, slot_mapping, **arrays)


FullState = make_dataclass(
    "FullState", [(name, np.ndarray) for name, _ in FULL_STATE_BASE]
    + [(f.array, np.ndarray | None, field(default=None)) for f in FULL_STATE_FIELDS],
    bases=(_FullStateMethods,), namespace={
        "__module__": __name__,
        "__doc__": """copy_policy="always": every decode input the parent owns, rebuilt and sent each step:
        positions (int64 [B]), active (bool [B]), block_table (int32 [B, max_blocks]), slot_mapping
        (int64 [B]), and the array of every per-row field a full state carries (named and typed by
        ROW_FIELDS; stop_ids int32 [B, S], each row's padded with -1). The output token counts are
        not sent: like the KV cache they are state the device builds. Neither are positions and
        slot_mapping (both None) under speculative decoding, where acceptance moves them on the
        device. Per-row arrays left None hold the neutral values, so a sender that knows only some
        fields still works."""})
