"""Structured outputs: request fields -> a grammar spec -> a per-request token matcher and bitmask.

The grammar engine is llguidance (why, and what it costs, is in the README's "Structured outputs"):
it builds token masks on the fly from a `tokenizers` tokenizer.json, takes JSON schema, regex,
Lark and llama.cpp-style GBNF (the EBNF vLLM's `grammar` field takes through xgrammar), and has no
Python dependencies.

- `StructuredSpec.from_request` reads OpenAI's `response_format`, vLLM's `structured_outputs` and
  the older `guided_*` fields into one spec, and raises ValueError naming the field for anything
  invalid (bad schema, regex or grammar; two constraints at once).
- `GrammarCompiler` (one per tokenizer) compiles specs in a thread pool, cached by spec; a request
  waits on its Future, the step loop does not.
- `Matcher` follows one request's tokens and fills its row of the packed int32 bitmask
  ([ceil(V / 32)] words, bit i of word w allows token 32 * w + i, the layout both llguidance and
  xgrammar use); `apply_bitmask` applies it to logits on any device.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from l3worker.tool_parsers import TOOL_CALL_END, TOOL_CALL_START

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# vLLM's `structured_outputs` keys that choose a constraint, and the guided_* field of each.
_SO_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. `value` is canonical text (a schema or a choice as compact JSON, key
    order kept: it is the order the properties are generated in), so equal constraints are equal
    specs: the compile cache's key."""

    kind: str
    value: str
    field: str = field(default="", compare=False)  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")

    @classmethod
    def from_request(
        cls,
        response_format: dict[str, Any] | None = None,
        structured_outputs: dict[str, Any] | None = None,
        guided_json: Any = None,
        guided_regex: Any = None,
        guided_choice: Any = None,
        guided_grammar: Any = None,
    ) -> "StructuredSpec | None":
        """The request's constraint, validated; None when it has none."""
        found: list[StructuredSpec] = []
        if response_format is not None:
            spec = _from_response_format(response_format)
            if spec is not None:
                found.append(spec)
        if structured_outputs is not None:
            if not isinstance(structured_outputs, dict):
                raise ValueError("structured_outputs must be an object")
            for key, value in structured_outputs.items():
                if value is None or value is False:
                    continue
                if key not in _SO_KEYS:
                    raise ValueError(f"structured_outputs.{key} is not supported")
                found.append(_spec(_SO_KEYS[key], value, f"structured_outputs.{key}"))
        guided = {"guided_json": guided_json, "guided_regex": guided_regex,
                  "guided_choice": guided_choice, "guided_grammar": guided_grammar}
        found += [_spec(_GUIDED[name], value, name) for name, value in guided.items() if value is not None]
        if len(found) > 1:
            raise ValueError(f"only one structured output constraint per request: {found[0].field} and "
                             f"{found[1].field} were both given")
        if not found:
            return None
        spec = found[0]
        error = llguidance.LLMatcher.validate_grammar(spec.grammar())
        if error:
            raise ValueError(f"{spec.field}: {error.strip()}")
        return spec

    def grammar(self) -> str:
        """The llguidance grammar for this spec; ValueError (naming the field) if it cannot be read."""
        try:
            if self.kind in ("json", "json_object"):
                return llguidance.LLMatcher.grammar_from_json_schema(self.value)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(self.value))
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.value))
        except Exception as exc:  # the GBNF converter raises its own error type
            raise ValueError(f"{self.field or self.kind}: {exc}") from None


def _from_response_format(fmt: Any) -> StructuredSpec | None:
    if not isinstance(fmt, dict):
        raise ValueError("response_format must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", '{"type": "object"}', "response_format")
    if kind != "json_schema":
        raise ValueError(f"response_format.type {kind!r} is not supported (text, json_object, json_schema)")
    body = fmt.get("json_schema")
    if not isinstance(body, dict) or "schema" not in body:
        raise ValueError("response_format.json_schema.schema is required")
    # strict: OpenAI holds the output to the schema exactly; without it an unsupported keyword
    # is ignored instead of refused.
    return _spec("json", body["schema"], "response_format.json_schema.schema",
                 lenient=not body.get("strict", False))


def _spec(kind: str, value: Any, field_name: str, lenient: bool = False) -> StructuredSpec:
    """Check the value's shape for its kind and canonicalise it."""
    if kind == "json_object":
        return StructuredSpec("json_object", '{"type": "object"}', field_name)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{field_name}: not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"{field_name} must be a JSON schema object")
        if lenient and isinstance(value, dict):
            value = {**value, "x-guidance": {**value.get("x-guidance", {}), "lenient": True}}
        return StructuredSpec("json", _compact(value), field_name)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{field_name} must be a non-empty list of strings")
        return StructuredSpec("choice", _compact(value), field_name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field_name} must be a non-empty string")
    return StructuredSpec(kind, value, field_name)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ---- tool_choice "required" / a named function ------------------------------------------------


def tool_choice_spec(tools: Sequence[dict[str, Any]], tool_choice: Any,
                     tags_are_tokens: bool = True) -> StructuredSpec | None:
    """The constraint that makes a model call a tool: None for `auto` and `none`.

    The output is held to the hermes format itself (`<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>`), not to vLLM's bare JSON array of {name, parameters}: the hermes parser
    then reads it like any other reply, and the call in the history is rendered by the chat template
    exactly as the model wrote it. `required` allows one or more calls of any listed function, a
    named function exactly one call of it; each call's arguments follow the function's parameters.
    `tags_are_tokens`: the tokenizer has `<tool_call>`/`</tool_call>` as added tokens (Qwen3's
    does). llguidance treats every added token as special, matched only by name in the grammar,
    never by text, so the tags are written as tokens there, as text otherwise.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools if t.get("type", "function") == "function"}
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice: 'required' needs at least one function in tools")
        chosen, repeat = list(functions), True
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise ValueError(f"tool_choice: function {name!r} is not in tools")
        chosen, repeat = [name], False
    else:
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}")
    # "name" first: the streaming parser announces a call once it has read the name
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": n},
                             "arguments": functions[n].get("parameters") or {"type": "object"}}}
             for n in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    open_tag, close_tag = ((TOOL_CALL_START, TOOL_CALL_END) if tags_are_tokens
                           else (json.dumps(TOOL_CALL_START), json.dumps(TOOL_CALL_END)))
    lark = ('start: call' + (' ("\\n" call)*' if repeat else '') + '\n'
            f'call: {open_tag} "\\n" body "\\n" {close_tag}\n'
            f'body: %json {_compact(schema)}\n')
    spec = StructuredSpec("grammar", lark, "tools")
    error = llguidance.LLMatcher.validate_grammar(spec.grammar())
    if error:
        raise ValueError(f"tools: {error.strip()}")
    return spec


# ---- compiling and matching -------------------------------------------------------------------


class Matcher:
    """One request's grammar state: accept the sampled tokens, fill the next step's mask row."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the matcher then stays
        in an error state: `error` says why)."""
        return self._m.consume_token(token_id)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into a contiguous int32 CPU row of ceil(V / 32) words."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("bitmask row must be a contiguous int32 CPU tensor")
        if row.numel() != bitmask_words(self.vocab_size):
            raise ValueError(f"bitmask row has {row.numel()} words, needs {bitmask_words(self.vocab_size)}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (or eos was accepted): the row stops."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (eos is allowed), though it may go on."""
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (run-ahead and speculation drop tokens)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


@dataclass
class CompiledGrammar:
    """A spec compiled for one tokenizer; each request gets a cheap copy of the pristine matcher."""

    spec: StructuredSpec
    _template: llguidance.LLMatcher
    vocab_size: int

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab_size)


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Compiles specs for one tokenizer off the step loop: a thread pool and an LRU cache by spec.

    `vocab_size` is the model's (its lm_head rows), which may exceed the tokenizer's: ids without a
    token are never allowed. `eos_token_ids` are the ids that end a reply (allowed once the
    grammar is complete).
    """

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 max_workers: int = 2, cache_size: int = 256) -> None:
        text = Path(tokenizer_json).read_text() if _is_path(tokenizer_json) else str(tokenizer_json)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[StructuredSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def submit(self, spec: StructuredSpec) -> Future[CompiledGrammar]:
        """The spec's compiled grammar, as a Future (done at once on a cache hit). A grammar the
        tokenizer cannot serve fails the Future with ValueError."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return fut
            self.stats.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        return self.submit(spec).result()

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        # llguidance builds the lexer and parser here, without the GIL
        template = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        if template.is_error():
            raise ValueError(f"{spec.field or spec.kind}: {template.get_error()}")
        return CompiledGrammar(spec, template, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_path(value: str | Path) -> bool:
    return isinstance(value, Path) or not str(value).lstrip().startswith("{")


# ---- bitmasks ---------------------------------------------------------------------------------


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """[batch, ceil(V / 32)] int32, every token allowed (rows without a grammar stay so)."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place: logits [B, V] on any device, bitmask [B, W] int32.

    Plain tensor ops, so it runs on every backend (CPU, CUDA, NPU) and inside a captured graph.
    llguidance's own torch version wraps the same ops in torch.compile, which needs a C++ or
    Triton toolchain at first call; xgrammar ships fused CUDA/Triton kernels, a later option for
    CUDA only.
    """
    batch, vocab = logits.shape
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(batch, -1).bool()
    if allowed.shape[1] < vocab:  # ids past the mask's words are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))
