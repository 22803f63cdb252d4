"""Qwen3 reasoning parser (`--reasoning-parser qwen3`): splits the model's text into the reasoning
between `<think>` and `</think>` and the answer after it.

Rules (vLLM's qwen3 parser is the reference point; where it is ambiguous the choice is said here):

- The think block is open from the start of the output when the rendered prompt already opened it
  (templates that end the generation prompt with `<think>`; `prompt_opens_think` tells from the
  prompt's tail). A `<think>` the model writes itself opens it too, but only at the start of the
  output (leading whitespace allowed); elsewhere `<think>` is ordinary text.
- `</think>` closes the block: what precedes it is reasoning, what follows is content.
- A block that is open and never closed was cut off (max_tokens): everything is reasoning and the
  content is None. vLLM's current qwen3 parser does the same with thinking enabled.
- No block open at all (`enable_thinking: false`, whose template closes an empty block in the
  prompt, or a non-thinking model): everything is content, `</think>` included. vLLM's older qwen3
  parser returned all content whenever a tag was missing; its current one treats text before a
  bare `</think>` as reasoning because it assumes the prompt opened the block. Knowing from the
  prompt whether it did makes both cases exact here.
- Empty reasoning or content is None (as the streamed fields are absent when nothing was sent).

`extract` parses a whole output; `ReasoningStream` parses it delta by delta and holds back only
text that may still become a tag, so the streamed pieces joined equal `extract`'s result.
The detokenizer must keep `<think>`/`</think>` in the text: Qwen3 marks them as added, not
special, tokens, so skip_special_tokens leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt leaves a think block open (its last `<think>` is unclosed)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.rfind(THINK_END) < start


def extract(text: str, prompt_opened_think: bool = False) -> tuple[str | None, str | None]:
    """Split a whole output into (reasoning, content); either is None when empty."""
    opened = prompt_opened_think
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        text, opened = stripped[len(THINK_START):], True
    if not opened:
        return None, text or None
    reasoning, sep, content = text.partition(THINK_END)
    return reasoning or None, (content or None) if sep else None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class ReasoningStream:
    """Incremental `extract`: feed() each text delta, finish() once at the end of the output."""

    _LEAD, _REASONING, _CONTENT = range(3)

    def __init__(self, prompt_opened_think: bool = False) -> None:
        self._opened = prompt_opened_think
        self._state = self._LEAD  # until the output's start shows whether it writes <think>
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """True while the text fed so far is (or may still be) reasoning; grammars start after."""
        return self._state == self._REASONING or (self._state == self._LEAD and self._opened)

    def feed(self, delta: str) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + delta
        self._held = ""
        if self._state == self._LEAD:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                text, self._opened = stripped[len(THINK_START):], True
            elif THINK_START.startswith(stripped):  # nothing but whitespace and a partial <think>
                self._held = text
                return ReasoningDelta()
            self._state = self._REASONING if self._opened else self._CONTENT
        if self._state == self._REASONING:
            before, sep, after = text.partition(THINK_END)
            if sep:
                reasoning.append(before)
                self._state, text = self._CONTENT, after
            else:
                keep = partial_suffix(text, THINK_END)
                reasoning.append(text[:len(text) - keep])
                self._held, text = text[len(text) - keep:], ""
        if self._state == self._CONTENT:
            content.append(text)
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)

    def finish(self) -> ReasoningDelta:
        """Release held text: the output ended, so no tag can complete any more."""
        held, self._held = self._held, ""
        if not held:
            return ReasoningDelta()
        if self._state == self._CONTENT or (self._state == self._LEAD and not self._opened):
            return ReasoningDelta(content=held)
        return ReasoningDelta(reasoning=held)
