"""The server's reading of chat replies without a server: reasoning and tool calls, whole and
streamed (every split joins to the whole parse), the OpenAI shape of streamed calls, assistant
tool calls in the history as the template sees them, the tool_choice rules, /tokenizer_info."""
from __future__ import annotations

import json

import pytest

from chip_child.models.tiny_model import CHAT_TEMPLATE, write_tiny_model
from l3worker.serving.openai.chat import ChatTemplate
from l3worker.serving.openai.chat_reply import ChatParsing, ReplyPiece, ReplyReader, openai_tool_deltas
from l3worker.serving.openai.errors import APIError
from l3worker.serving.openai.protocol import ChatCompletionRequest
from l3worker.serving.openai.tokenizer_info import tokenizer_info
from l3worker.serving.openai.translate import ServedModel, _message_dict

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = [
    "<think>\nhmm\n</think>\n\nIt is sunny.",
    "<think>\nhmm\n</think>\n\n" + CALL,
    "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"),
    "hmm, still thinking",  # with the prompt's think block open: cut by max_tokens
    "plain </think> text <tool_call>not json</tool_call>",
]
KINDS = [(True, True, False), (True, True, True), (True, False, False), (False, True, False)]


def joined(pieces: list[ReplyPiece]) -> ReplyPiece:
    total = ReplyPiece()
    for p in pieces:
        total.add(p)
    return total


def stream(reader: ReplyReader, parts: list[str]) -> ReplyPiece:
    return joined([reader.feed(p) for p in parts] + [reader.finish()])


def shape(piece: ReplyPiece) -> tuple:
    """What a client keeps of a reply: ids are random, so only the calls' names and arguments."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in piece.tool_calls]
    return piece.reasoning, piece.content, calls


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_split_of_a_stream_joins_to_the_whole_reply(text, kind) -> None:
    reader = ReplyReader(*kind)
    whole = reader.whole(text)
    for cut in range(len(text) + 1):
        assert shape(stream(reader.fresh(), [text[:cut], text[cut:]])) == shape(whole), cut
    assert shape(stream(reader.fresh(), list(text))) == shape(whole)


def test_whole_replies() -> None:
    assert shape(ReplyReader(True, True, False).whole(REPLIES[1])) == \
        ("\nhmm\n", None, [("get_weather", '{"city": "Paris"}')])
    assert shape(ReplyReader(True, True, True).whole(REPLIES[3])) == ("hmm, still thinking", None, [])
    assert shape(ReplyReader(True, False, False).whole(REPLIES[1])) == ("\nhmm\n", "\n\n" + CALL, [])
    text = REPLIES[2]
    assert shape(ReplyReader(False, True, False).whole(text)) == \
        (None, "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])


def test_streamed_calls_take_openais_shape() -> None:
    announced = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}
    assert openai_tool_deltas([announced, second, {"index": 1, "function": {"arguments": "{\"x\""}}]) == [
        [{**announced, "function": {"name": "f", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": "{}"}}, second, {"index": 1, "function": {"arguments": "{\"x\""}}],
    ]
    piece = ReplyPiece(tool_calls=[dict(second, function=dict(second["function"]))])
    piece.add(ReplyPiece(tool_calls=[{"index": 1, "function": {"arguments": "{}"}}]))
    assert piece.tool_calls == [{**second, "function": {"name": "g", "arguments": "{}"}}]  # one entry per call


def test_parser_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ChatParsing(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatParsing(tool_call_parser="json")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatParsing(auto_tool_choice=True)


def test_assistant_tool_call_arguments_reach_the_template_as_an_object() -> None:
    req = ChatCompletionRequest(messages=[
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assistant, tool = (_message_dict(m, i) for i, m in enumerate(req.messages))
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"city": "Paris"}, "not json"]
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    rendered = ChatTemplate(CHAT_TEMPLATE).render([_message_dict(m, 0) for m in req.messages[:1]],
                                                  add_generation_prompt=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered


def _model(parsing: ChatParsing) -> ServedModel:
    return ServedModel(names=("m",), model_dir="", max_model_len=64, vocab_size=10, tokens=None,
                       chat_template=None, parsing=parsing)


@pytest.mark.parametrize("tools, tool_choice, auto, parses", [
    (None, None, True, False), (None, "auto", True, False), ([{"type": "function"}], None, True, True),
    ([{"type": "function"}], "auto", True, True), ([{"type": "function"}], "none", True, False),
    ([{"type": "function"}], "none", False, False)])
def test_tool_choice_decides_whether_calls_are_parsed(tools, tool_choice, auto, parses) -> None:
    model = _model(ChatParsing(tool_call_parser="hermes", auto_tool_choice=auto))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=tool_choice)
    assert model.parses_tools(req) is parses


def test_auto_tool_choice_needs_the_server_flag() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(APIError) as e:
        _model(ChatParsing()).parses_tools(req)
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message


def test_tokenizer_info_is_the_tokenizer_config(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "tiny")
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"257": {"content": "<|im_start|>", "special": True}}
    config["vocab_file"] = "vocab.json"
    (tiny / "tokenizer_config.json").write_text(json.dumps(config))
    info = tokenizer_info(tiny, ChatTemplate("override"))
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] is None
    assert info["added_tokens_decoder"] == {"257": "<|im_start|>"} and "vocab_file" not in info
    assert info["chat_template"] == "override" and info["tokenizer_class"] == "PreTrainedTokenizerFast"
    bare = tokenizer_info(tmp_path / "none", None)
    assert bare == {"bos_token": None, "eos_token": None, "pad_token": None, "unk_token": None,
                    "tokenizer_class": "PreTrainedTokenizerFast"}
