"""Structured outputs through the API, with the official openai client, on the built-in random-weight
model: every constrained reply satisfies its constraint (checked with jsonschema, re.fullmatch, the
choice list, the tool-call parser), on /v1/chat/completions and /v1/completions alike."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from l3worker import DistributedWorker
from l3worker.serving.runner import ServeOptions, ServerThread
from schemas import SCHEMA  # bounded strings, numbers and arrays: a random model finishes it

WORKER = dict(max_batch_size=4, max_seq_len=1536, page_size=16)
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Describe a user."}]
SEEDS = range(4)


class User(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=150)
    role: Literal["admin", "user"]
    ok: bool


@pytest.fixture(scope="module")
def server():
    with ServerThread(DistributedWorker(None, **WORKER), options=ServeOptions(port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(oai, seed: int, **body) -> openai.types.chat.ChatCompletion:
    extra = {k: body.pop(k) for k in list(body) if k.startswith(("guided_", "structured_"))}
    body = {"max_tokens": 200, **body}
    return oai.chat.completions.create(model="l3worker-tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                       extra_body=extra or None, **body)


def complete(oai, seed: int, **extra) -> openai.types.Completion:
    return oai.completions.create(model="l3worker-tiny", prompt="A user:", max_tokens=200, temperature=1.0, seed=seed,
                                  extra_body=extra)


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_parse_with_a_pydantic_model(oai, seed) -> None:
    r = oai.chat.completions.parse(model="l3worker-tiny", messages=MESSAGES, response_format=User, max_tokens=200,
                                   temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, User), choice.message.content


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_on_chat_and_completions(oai, seed) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    texts = [chat(oai, seed, response_format=fmt).choices[0].message.content,
             complete(oai, seed, response_format=fmt).choices[0].text,
             complete(oai, seed, structured_outputs={"json": SCHEMA}).choices[0].text,
             chat(oai, seed, guided_json=SCHEMA).choices[0].message.content]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_is_an_object(oai) -> None:
    for seed in SEEDS:
        r = chat(oai, seed, response_format={"type": "json_object"}, max_tokens=400).choices[0]
        assert r.message.content.startswith("{")
        if r.finish_reason == "stop":  # a random model's free-form object may be cut by max_tokens
            assert isinstance(json.loads(r.message.content), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_and_choice_on_chat_and_completions(oai, seed) -> None:
    regexes = [chat(oai, seed, guided_regex=REGEX).choices[0].message.content,
               complete(oai, seed, structured_outputs={"regex": REGEX}).choices[0].text,
               complete(oai, seed, guided_regex=REGEX).choices[0].text]
    for text in regexes:
        assert re.fullmatch(REGEX, text), text
    choices = [chat(oai, seed, structured_outputs={"choice": CHOICES}).choices[0],
               complete(oai, seed, guided_choice=CHOICES).choices[0]]
    for c in choices:
        text = c.message.content if hasattr(c, "message") else c.text
        assert text in CHOICES and c.finish_reason == "stop"


def test_ebnf_grammar(oai) -> None:
    grammar = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    for seed in SEEDS:
        text = complete(oai, seed, structured_outputs={"grammar": grammar}).choices[0].text
        assert re.fullmatch(r"(yes|no) [0-9]", text), text


def test_streamed_constrained_reply_is_the_whole_one(oai) -> None:
    whole = chat(oai, 3, guided_json=SCHEMA).choices[0]
    stream = oai.chat.completions.create(model="l3worker-tiny", messages=MESSAGES, max_tokens=200, temperature=1.0,
                                         seed=3, stream=True, extra_body={"guided_json": SCHEMA})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].finish_reason == whole.finish_reason == "stop"


@pytest.mark.parametrize("seed", SEEDS)
def test_tool_choice_required_and_named_give_valid_calls(oai, seed) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    required = chat(oai, seed, tools=TOOLS, tool_choice="required").choices[0]
    named = chat(oai, seed, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
                 ).choices[0]
    for choice, names in ((required, set(params)), (named, {"get_weather"})):
        calls = choice.message.tool_calls
        assert calls and choice.finish_reason == "tool_calls", choice
        for call in calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert len(named.message.tool_calls) == 1


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format", "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs", "structured_outputs.regex"),
    ("/v1/completions", {"guided_grammar": "root ::= missing"}, "guided_grammar", "guided_grammar"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "only one"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not in tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "at least one function"),
])
def test_invalid_constraints_are_400_naming_the_field(http, path, body, param, needle) -> None:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    r = http.post(path, json={**prompt, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_with_a_reasoning_parser_the_constraint_starts_after_think_end() -> None:
    from tokenizers import Tokenizer

    from chip_child.models.tiny_model import ensure_tiny_model
    from l3worker.serving.openai.chat_reply import ChatParsing
    from l3worker.serving.openai.protocol import CompletionRequest
    from l3worker.serving.openai.tokens import Tokens
    from l3worker.serving.openai.translate import ServedModel

    d = ensure_tiny_model()
    tokens = Tokens(Tokenizer.from_file(str(d / "tokenizer.json")))
    model = ServedModel(("m",), str(d), 512, 320, tokens, None, parsing=ChatParsing(reasoning_parser="qwen3"))
    end = tokens.tokenizer.token_to_id("</think>")
    req = CompletionRequest(prompt="x", guided_regex="a")
    thinking = tokens.encode("<|im_start|>assistant\n")
    closed = tokens.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert model.structured(req, thinking)["reasoning_end_token_id"] == end
    assert model.structured(req, closed)["reasoning_end_token_id"] is None  # thinking disabled: from the start
    plain = ServedModel(("m",), str(d), 512, 320, tokens, None)
    assert plain.structured(req, thinking)["reasoning_end_token_id"] is None
