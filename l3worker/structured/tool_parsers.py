"""Hermes tool-call parser (`--tool-call-parser hermes`), the format Qwen3's chat template asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each block becomes an OpenAI tool call `{id, type: "function", function: {name, arguments}}`.
`arguments` is the JSON text of the block's "arguments" value exactly as the model wrote it (so the
streamed fragments join to it); a block without "arguments" calls with "{}". What makes a block a
call is that its object has a string "name" and, if present, a complete JSON value for "arguments";
anything after those (the closing brace, stray text) is not checked, since a model that forgets the
final brace still meant the call. A block that is not a call stays in the content verbatim, tags
included. A `<tool_call>` never closed (output cut or ended) is parsed up to the end of the output.
Content is the text outside the calls with leading and trailing whitespace removed, None when
empty: the newlines around a call are layout, not an answer.

Streaming (`ToolCallStream`) announces a call (index, id, type, function.name, arguments "") as
soon as its name and the start of its arguments have arrived, then sends argument fragments as they
come. Joined, the stream equals `parse_tool_calls` for every split of the text, with one exception
it cannot avoid without holding back whole calls: arguments whose JSON breaks after they started
streaming are sent as written, where the whole-output parser keeps that block as content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from l3worker.structured.reasoning import partial_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_ID_ALPHABET = string.ascii_letters + string.digits
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def make_tool_call_id() -> str:
    """OpenAI's shape of tool-call id: "call_" and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class _Head:
    """Where a block's call stands: its name and the span of its "arguments" value in the block."""

    name: str
    args_start: int | None  # None: the object closed without "arguments"
    args_end: int | None  # None: not decoded yet (streaming stops at the value's start)


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _read_head(text: str, decode_args: bool) -> _Head | None:
    """Walk the block's top-level object key by key until the name and the arguments are known.

    None when the text (so far) does not show a call: malformed, or simply not complete yet.
    With decode_args False the walk stops at the start of "arguments" once the name is known.
    """
    name: str | None = None
    args: tuple[int, int] | None = None
    i = _skip_ws(text, 0)
    if not text.startswith("{", i):
        return None
    i += 1
    first = True
    try:
        while True:
            i = _skip_ws(text, i)
            if text.startswith("}", i):
                return _Head(name, None, None) if name is not None and args is None else None
            if not first:
                if not text.startswith(",", i):
                    return None
                i = _skip_ws(text, i + 1)
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if not isinstance(key, str) or not text.startswith(":", i):
                return None
            i = _skip_ws(text, i + 1)
            if key == "arguments" and name is not None and not decode_args:
                return _Head(name, i, None)
            value, end = _DECODER.raw_decode(text, i)
            if key == "name":
                if not isinstance(value, str):
                    return None
                name = value
            elif key == "arguments":
                args = (i, end)
            if name is not None and args is not None:
                return _Head(name, *args)
            i, first = end, False
    except (json.JSONDecodeError, IndexError):
        return None


def _call_of(block: str) -> ToolCall | None:
    head = _read_head(block, decode_args=True)
    if head is None:
        return None
    arguments = "{}" if head.args_start is None else block[head.args_start:head.args_end]
    return ToolCall(head.name, arguments)


def _unclosed_block(rest: str) -> str:
    """An unclosed block's text: what follows <tool_call>, less a trailing piece of </tool_call>."""
    return rest[:len(rest) - partial_suffix(rest, TOOL_CALL_END)]


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Whole-output parse: the calls in order and the content outside them."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body)
        block = text[body:end] if end >= 0 else _unclosed_block(text[body:])
        pos = end + len(TOOL_CALL_END) if end >= 0 else len(text)
        call = _call_of(block)
        if call is None:
            content.append(text[start:pos])
        else:
            calls.append(call)
    content.append(text[pos:])
    return ParsedToolCalls("".join(content).strip() or None, calls)


@dataclass
class ToolStreamDelta:
    content: str | None = None
    # OpenAI delta entries: {index, id, type, function: {name, arguments}} for a new call, then
    # {index, function: {arguments}}; at most one entry per index in one delta.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class _ArgsScanner:
    """Finds where a JSON value ends while its text streams in (strings, escapes, nesting)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos  # next index of the block text to scan
        self.start: int | None = None  # where the value begins, once a non-space has arrived
        self.kind = ""  # "container", "string" or "scalar", from the first character
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> tuple[int, bool]:
        """Scan what is new in text; returns (end of the value's settled text, value complete)."""
        while self.pos < len(text):
            i, c = self.pos, text[self.pos]
            self.pos += 1
            if self.start is None:
                if c not in " \t\r\n":
                    self.start = i
                    self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
                    self.depth = 1 if self.kind == "container" else 0
                    self.in_string = self.kind == "string"
                continue
            if self.kind == "scalar":
                if c in " \t\r\n,}]":
                    return i, True
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return i + 1, True
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        if self.start is None:
            return self.pos, False
        # a scalar's text is settled only once a delimiter shows where it ends
        return (self.start if self.kind == "scalar" else len(text)), False


class ToolCallStream:
    """Incremental `parse_tool_calls`: feed() each text delta, finish() once at the end."""

    def __init__(self) -> None:
        self._held = ""  # outside a block: a possible start of <tool_call>
        self._block: str | None = None  # inside a block: its text so far
        self._index = -1  # index of the current/last announced call
        self._open_block()
        self._block = None
        self._content_started = False
        self._content_ws = ""  # trailing whitespace held until more content shows it is interior

    def feed(self, delta: str) -> ToolStreamDelta:
        out = ToolStreamDelta()
        text = self._held + delta
        self._held = ""
        while text:
            if self._block is None:
                start = text.find(TOOL_CALL_START)
                if start < 0:
                    keep = partial_suffix(text, TOOL_CALL_START)
                    self._content(out, text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                self._content(out, text[:start])
                self._open_block()
                text = text[start + len(TOOL_CALL_START):]
            else:
                self._block += text
                end = self._block.find(TOOL_CALL_END)
                if end < 0:
                    visible = self._block[:len(self._block) - partial_suffix(self._block, TOOL_CALL_END)]
                    self._advance(out, visible)
                    break
                block, text = self._block[:end], self._block[end + len(TOOL_CALL_END):]
                self._close_block(out, block, block + TOOL_CALL_END)
        return out

    def finish(self) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if self._block is not None:
            raw = self._block
            self._close_block(out, _unclosed_block(raw), raw)
        elif self._held:
            self._content(out, self._held)
        self._held = ""
        return out

    # -- content --------------------------------------------------------------------------------

    def _content(self, out: ToolStreamDelta, text: str) -> None:
        """Send content with the leading and trailing whitespace of the whole content dropped."""
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        combined = self._content_ws + text
        body = combined.rstrip()
        self._content_ws = combined[len(body):]
        if body:
            out.content = (out.content or "") + body

    # -- blocks ---------------------------------------------------------------------------------

    def _open_block(self) -> None:
        self._block = ""
        self._announced = False
        self._scanner: _ArgsScanner | None = None  # set once the arguments' position is known
        self._args_sent = 0  # block text sent as arguments ends here
        self._args_done = False

    def _announce(self, out: ToolStreamDelta, name: str) -> None:
        self._index += 1
        self._announced = True
        out.tool_calls.append({"index": self._index, "id": make_tool_call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})

    def _send_args(self, out: ToolStreamDelta, fragment: str) -> None:
        if not fragment:
            return
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last["index"] == self._index:  # one entry per call per delta
            last["function"]["arguments"] += fragment
        else:
            out.tool_calls.append({"index": self._index, "function": {"arguments": fragment}})

    def _advance(self, out: ToolStreamDelta, visible: str) -> None:
        """Announce the call once its head is readable, then stream its arguments' settled text."""
        if not self._announced:
            head = _read_head(visible, decode_args=False)
            if head is None or head.args_start is None:
                return  # not readable yet, or closed without arguments: settled at the block's end
            self._announce(out, head.name)
            if head.args_end is not None:  # "arguments" came before "name": already whole
                self._send_args(out, visible[head.args_start:head.args_end])
                self._args_done = True
                return
            self._scanner = _ArgsScanner(head.args_start)
        if self._args_done or self._scanner is None:
            return
        upto, self._args_done = self._scanner.scan(visible)
        if self._scanner.start is not None:
            self._send_args(out, visible[max(self._args_sent, self._scanner.start):upto])
            self._args_sent = max(self._args_sent, upto)

    def _sent_args(self, block: str) -> str:
        scanner = self._scanner
        if scanner is None or scanner.start is None:
            return ""
        return block[scanner.start:max(self._args_sent, scanner.start)]

    def _close_block(self, out: ToolStreamDelta, block: str, raw: str) -> None:
        self._advance(out, block)
        self._block = None
        call = _call_of(block)
        if self._announced:
            if self._args_done and self._scanner is None:
                return  # sent whole when announced
            sent = self._sent_args(block)
            if call is not None and call.arguments.startswith(sent):
                self._send_args(out, call.arguments[len(sent):])
            return  # a call whose arguments broke after streaming began stays as sent
        if call is None:
            self._content(out, TOOL_CALL_START + raw)
            return
        self._announce(out, call.name)
        self._send_args(out, call.arguments)


def join_stream_deltas(deltas: list[ToolStreamDelta]) -> tuple[str | None, list[dict[str, Any]]]:
    """Accumulate streamed deltas the way an OpenAI client does: (content, tool calls)."""
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for entry in d.tool_calls:
            call = calls.setdefault(entry["index"], {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            call["id"] = entry.get("id", call["id"])
            call["function"]["name"] += entry["function"].get("name", "")
            call["function"]["arguments"] += entry["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]
