"""Structured outputs: request fields -> a grammar spec (llguidance grammar text).

The grammar engine is llguidance (why, and what it costs, is in the README's "Structured outputs"):
it takes JSON schema, regex, Lark and llama.cpp-style GBNF (the EBNF vLLM's `grammar` field takes
through xgrammar), and has no Python dependencies. Compiling, matching and masking live beside the
sampler, in chip_child.sampling.grammar.

- `StructuredSpec.from_request` reads OpenAI's `response_format`, vLLM's `structured_outputs` and
  the older `guided_*` fields into one spec, and raises ValueError naming the field for anything
  invalid (bad schema, regex or grammar; two constraints at once). `StructuredSpec.of` takes what
  an offline caller gives `SamplingParams(structured_outputs=...)`.
- `tool_choice_spec`: the grammar that holds `tool_choice` "required" / a named function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from l3worker.structured.tool_parsers import TOOL_CALL_END, TOOL_CALL_START

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# vLLM's `structured_outputs` keys that choose a constraint, and the guided_* field of each.
_SO_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): llguidance's flexible
# whitespace lets a weak or random model write blanks until max_tokens. A schema's own
# "x-guidance" options override these.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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
        return found[0].validated()

    @classmethod
    def of(cls, value: "StructuredSpec | dict[str, Any]") -> "StructuredSpec":
        """SamplingParams(structured_outputs=...): a spec, or a dict of vLLM's `structured_outputs`
        keys ({"json": schema}, {"regex": ...}, ...), validated."""
        if isinstance(value, StructuredSpec):
            return value.validated()
        if not isinstance(value, dict):
            raise TypeError(f"structured_outputs must be a StructuredSpec or a dict, got {type(value).__name__}")
        spec = cls.from_request(structured_outputs=value)
        if spec is None:
            raise ValueError("structured_outputs: no constraint given (json, regex, choice, grammar or json_object)")
        return spec

    def validated(self) -> "StructuredSpec":
        """Itself, once llguidance accepts its grammar; ValueError naming the field otherwise."""
        error = llguidance.LLMatcher.validate_grammar(self.grammar_text)
        if error:
            raise ValueError(f"{self.field or self.kind}: {error.strip()}")
        return self

    @cached_property
    def grammar_text(self) -> str:
        """grammar(), converted once: the text the chip-child and the compilers receive."""
        return self.grammar()

    def grammar(self) -> str:
        """The llguidance grammar for this spec; ValueError (naming the field) if it cannot be read."""
        try:
            if self.kind in ("json", "json_object"):
                return llguidance.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_FORMAT)
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
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_FORMAT}  # top level only
    open_tag, close_tag = ((TOOL_CALL_START, TOOL_CALL_END) if tags_are_tokens
                           else (json.dumps(TOOL_CALL_START), json.dumps(TOOL_CALL_END)))
    lark = ('start: call' + (' ("\\n" call)*' if repeat else '') + '\n'
            f'call: {open_tag} "\\n" body "\\n" {close_tag}\n'
            f'body: %json {_compact(schema)}\n')
    return StructuredSpec("grammar", lark, "tools").validated()
