"""A chat reply read by the server's parsers: the reasoning split off first (`--reasoning-parser
qwen3`), then tool calls parsed from the rest (`--tool-call-parser hermes`), whole or delta by delta.

Tool calls are looked for only in the content, never in the reasoning, as vLLM does. The streamed
pieces of one reply join to what the whole-reply parse gives (see reasoning.py and tool_parsers.py
for the one exception: arguments that break after they started streaming)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from l3worker.structured.reasoning import ReasoningDelta, ReasoningStream, extract
from l3worker.structured.tool_parsers import ToolCallStream, ToolStreamDelta, parse_tool_calls

REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ChatParsing:
    """Which parsers the server runs over chat replies (fixed at start-up)."""

    reasoning_parser: str | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # --tool-call-parser
    auto_tool_choice: bool = False  # --enable-auto-tool-choice

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class ReplyPiece:
    """A reply's parts, whole or (streaming) what is new; None or [] where there is nothing."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: "ReplyPiece") -> None:
        self.reasoning = _join(self.reasoning, other.reasoning)
        self.content = _join(self.content, other.content)
        for entry in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last["index"] == entry["index"] and "id" not in entry:
                last["function"]["arguments"] += entry["function"]["arguments"]  # one entry per call
            else:
                self.tool_calls.append(entry)


def _join(a: str | None, b: str | None) -> str | None:
    return a + b if a is not None and b is not None else a if b is None else b


class ReplyReader:
    """Parses one choice's reply. `reasoning`: split off the think block; `tools`: parse hermes
    calls; `prompt_opened_think`: the rendered prompt left a think block open."""

    def __init__(self, reasoning: bool, tools: bool, prompt_opened_think: bool):
        self.reasoning = reasoning
        self.tools = tools
        self.prompt_opened_think = prompt_opened_think
        self._reasoning_stream = ReasoningStream(prompt_opened_think) if reasoning else None
        self._tool_stream = ToolCallStream() if tools else None
        self.called = False  # a tool call was streamed

    def fresh(self) -> "ReplyReader":
        """A reader of the same kind for another choice (streaming keeps state per choice)."""
        return ReplyReader(self.reasoning, self.tools, self.prompt_opened_think)

    def whole(self, text: str) -> ReplyPiece:
        reasoning, content = extract(text, self.prompt_opened_think) if self.reasoning else (None, text)
        if not self.tools:
            return ReplyPiece(reasoning, content)
        parsed = parse_tool_calls(content or "")
        return ReplyPiece(reasoning, parsed.content, [c.to_openai() for c in parsed.tool_calls])

    def feed(self, delta: str) -> ReplyPiece:
        return self._take(self._reasoning_stream.feed(delta) if self._reasoning_stream
                          else ReasoningDelta(content=delta), final=False)

    def finish(self) -> ReplyPiece:
        return self._take(self._reasoning_stream.finish() if self._reasoning_stream else ReasoningDelta(),
                          final=True)

    def _take(self, split: ReasoningDelta, final: bool) -> ReplyPiece:
        piece = ReplyPiece(reasoning=split.reasoning)
        if self._tool_stream is None:
            piece.content = split.content
            return piece
        tools = self._tool_stream.feed(split.content or "")
        piece.add(_from_tools(tools))
        if final:
            piece.add(_from_tools(self._tool_stream.finish()))
        self.called = self.called or bool(piece.tool_calls)
        return piece


def _from_tools(d: ToolStreamDelta) -> ReplyPiece:
    return ReplyPiece(content=d.content, tool_calls=d.tool_calls)


def openai_tool_deltas(entries: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Streamed tool-call entries regrouped into successive deltas in OpenAI's shape: a call's first
    delta has its index, id, type, name and empty arguments; its arguments come in a later delta
    (a parser that saw the whole call at once announces it with its arguments)."""
    groups: list[list[dict[str, Any]]] = [[]]
    for entry in entries:
        fn = entry["function"]
        if "id" in entry and fn.get("arguments"):
            groups[-1].append({**entry, "function": {"name": fn["name"], "arguments": ""}})
            groups.append([{"index": entry["index"], "function": {"arguments": fn["arguments"]}}])
        else:
            groups[-1].append(entry)
    return [g for g in groups if g]
