"""Qwen3 reasoning parser: whole-output extraction and streaming that joins to the same result."""

from __future__ import annotations

import pytest
from text_splits import splits

from l3worker.structured.reasoning import ReasoningStream, extract, prompt_opens_think


def stream(pieces: list[str], opened: bool) -> tuple[str | None, str | None]:
    parser = ReasoningStream(prompt_opened_think=opened)
    reasoning: list[str] = []
    content: list[str] = []
    for d in [*(parser.feed(p) for p in pieces), parser.finish()]:
        reasoning.append(d.reasoning or "")
        content.append(d.content or "")
    return "".join(reasoning) or None, "".join(content) or None


CASES = [
    # (output text, prompt opened <think>, expected (reasoning, content))
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, ("\nLet me see.\n", "\n\nThe answer is 4.")),
    ("Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    ("<think>x</think>y", True, ("x", "y")),  # the model repeats <think> after the prompt opened it
    ("  <think>abc</think>", False, ("abc", None)),  # stopped right after </think>
    ("<think>cut off by max_tok", False, ("cut off by max_tok", None)),
    ("cut off mid-tag </thi", True, ("cut off mid-tag </thi", None)),
    ("Plain answer, thinking disabled.", False, (None, "Plain answer, thinking disabled.")),
    ("answer with </think> in it", False, (None, "answer with </think> in it")),
    ("answer mentions <think> later", False, (None, "answer mentions <think> later")),
    ("<thinking is not a tag", False, (None, "<thinking is not a tag")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("</think>only content", True, (None, "only content")),
    ("  ", False, (None, "  ")),
    ("  ", True, ("  ", None)),
    ("", False, (None, None)),
    ("<th", False, (None, "<th")),
    ("<th", True, ("<th", None)),
    ("思考</think>答え", True, ("思考", "答え")),
]


@pytest.mark.parametrize("text,opened,expected", CASES)
def test_extract(text: str, opened: bool, expected: tuple) -> None:
    assert extract(text, prompt_opened_think=opened) == expected


@pytest.mark.parametrize("text,opened,expected", CASES)
def test_stream_joins_to_extract_for_every_split(text: str, opened: bool, expected: tuple) -> None:
    for pieces in splits(text):
        assert stream(pieces, opened) == expected, pieces


def test_stream_sends_reasoning_before_the_end_tag_arrives() -> None:
    parser = ReasoningStream(prompt_opened_think=True)
    assert parser.in_reasoning
    first = parser.feed("step one </th")
    assert (first.reasoning, first.content) == ("step one ", None)  # "</th" held: may become </think>
    second = parser.feed("ink>done")
    assert (second.reasoning, second.content) == (None, "done")
    assert not parser.in_reasoning


def test_stream_held_lead_is_released_as_content_without_think() -> None:
    parser = ReasoningStream()
    assert parser.feed("\n").content is None  # could still be "\n<think>"
    assert parser.feed("Hi").content == "\nHi"


def test_prompt_opens_think() -> None:
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    # enable_thinking=False: Qwen3's template closes an empty block in the prompt
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    # an earlier turn's closed block does not count; the final open one does
    assert prompt_opens_think("<think>a</think>b<|im_start|>assistant\n<think>")
