"""Server parts that need no engine: chat templates against transformers' renderer, logprobs shapes,
token bytes, request validation, the body limit on a chunked upload."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from starlette.responses import JSONResponse

from chip_child.models.tiny_model import write_tiny_model
from l3worker.params import TokenLogprob
from l3worker.serving.openai.chat import ChatTemplate, ChatTemplateError
from l3worker.serving.openai.errors import APIError
from l3worker.serving.openai.middleware import BodyLimit
from l3worker.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from l3worker.serving.openai.responses import LOGPROB_FLOOR, TokenFormatter, sse
from l3worker.serving.openai.tokens import Tokens
from l3worker.serving.openai.translate import GenerationDefaults, ServedModel
from l3worker.serving.runner import bind, run_server

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "weather in Zürich?"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "because"}],
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "Weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokens(tiny) -> Tokens:
    from chip_child.models.loader import load_tokenizer
    return Tokens(load_tokenizer(tiny))


# -- chat templates --------------------------------------------------------------------------------
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                    dict(add_generation_prompt=True, enable_thinking=False),
                                    dict(add_generation_prompt=True, tools=TOOLS)])
def test_tiny_template_renders_as_transformers_does(tiny, conversation, kwargs) -> None:
    from transformers import AutoTokenizer

    template = ChatTemplate.load(tiny)
    reference = AutoTokenizer.from_pretrained(tiny).apply_chat_template(conversation, tokenize=False, **kwargs)
    assert template.render(conversation, **kwargs) == reference


def test_tiny_template_has_qwen3_shape(tiny, tokens) -> None:
    template = ChatTemplate.load(tiny)
    text = template.render(CONVERSATIONS[1], enable_thinking=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokens.encode(text)
    assert ids.count(257) == 5 and ids.count(258) == 4 and ids.count(259) == 1 and ids.count(260) == 1
    assert template.special_tokens == {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


def test_template_environment_matches_transformers(tmp_path) -> None:
    source = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
              "{% endif %}{{ m | tojson }}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}")
    template = ChatTemplate(source, {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "é"}, {"role": "x"}]) == \
        '<s>{"role": "user", "content": "é"}'
    with pytest.raises(ChatTemplateError, match="no bad"):
        template.render([{"role": "bad"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses to reach Python internals
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ValueError, match="syntax error on line 1"):
        ChatTemplate("{% for %}")


def test_template_sources_in_order(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
         "eos_token": {"content": "</s>", "special": True}}))
    assert ChatTemplate.load(tmp_path).render([]) == "D"
    assert ChatTemplate.load(tmp_path).special_tokens == {"eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.load(tmp_path).render([]) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("M{{ eos_token }}")
    assert ChatTemplate.load(tmp_path, override).render([]) == "M</s>"
    assert ChatTemplate.load(tmp_path / "missing") is None


# -- tokens and logprobs -----------------------------------------------------------------------------
def test_token_bytes_and_text(tokens) -> None:
    assert tokens.token_bytes(0xE4) == b"\xe4" and tokens.token_text(0xE4) == "\ufffd"
    assert tokens.token_bytes(32) == b" " and tokens.token_bytes(10) == b"\n"
    assert tokens.token_bytes(257) == b"<|im_start|>" and tokens.token_bytes(259) == b"<think>"
    assert tokens.token_bytes(300) == b""  # a padding id with no token


def test_completion_logprobs_format(tokens) -> None:
    fmt = TokenFormatter(tokens)
    entries = [(72, None), (105, TokenLogprob(105, -0.5, ((105, -0.5), (33, -1.5)))),
               (33, TokenLogprob(33, -math.inf, ((105, -0.1),))),
               (0xC3, TokenLogprob(0xC3, -2.0, ((0xE4, -1.0), (0xC3, -2.0), (97, -3.0))))]
    lp, offset = fmt.completion_logprobs(entries, 0)
    assert lp == {"tokens": ["H", "i", "!", "\ufffd"], "token_logprobs": [None, -0.5, LOGPROB_FLOOR, -2.0],
                  "top_logprobs": [None, {"i": -0.5, "!": -1.5}, {"i": -0.1, "!": LOGPROB_FLOOR},
                                   {"\ufffd": -1.0, "a": -3.0}],  # 0xE4 reads as 0xC3 does: the likelier kept
                  "text_offset": [0, 1, 2, 3]}
    assert offset == 4
    json.loads(sse(lp)[len("data: "):])  # no -Infinity in the JSON
    # lm-eval's is_greedy (the token's value equals the largest in top_logprobs) holds only for the greedy one
    assert [tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:])] == \
        [True, False, False]


def test_completion_logprobs_as_token_ids(tokens) -> None:
    fmt = TokenFormatter(tokens, as_ids=True)
    lp, offset = fmt.completion_logprobs([(72, None), (0xC3, TokenLogprob(0xC3, -2.0, ((0xE4, -1.0),)))], 0)
    assert lp == {"tokens": ["token_id:72", "token_id:195"], "token_logprobs": [None, -2.0],
                  "top_logprobs": [None, {"token_id:195": -2.0, "token_id:228": -1.0}],
                  "text_offset": [0, 1]}  # offsets still count the text
    assert offset == 2
    chat = fmt.chat_logprobs([TokenLogprob(0xC3, -2.0, ((0xE4, -1.0),))], top_n=1)["content"][0]
    assert (chat["token"], chat["bytes"], chat["top_logprobs"][0]["token"]) == ("token_id:195", [0xC3], "token_id:228")


def test_chat_logprobs_format(tokens) -> None:
    fmt = TokenFormatter(tokens)
    got = fmt.chat_logprobs([TokenLogprob(0xC3, -0.25, ((0xC3, -0.25), (97, -2.0), (98, -3.0)))], top_n=2)
    assert got == {"refusal": None, "content": [{
        "token": "\ufffd", "logprob": -0.25, "bytes": [0xC3],
        "top_logprobs": [{"token": "\ufffd", "logprob": -0.25, "bytes": [0xC3]},
                         {"token": "a", "logprob": -2.0, "bytes": [97]}]}]}
    no_tokenizer = TokenFormatter(None)
    assert no_tokenizer.chat_logprobs([TokenLogprob(7, -1.0)], 0)["content"][0]["token"] == "token_id:7"


# -- requests ------------------------------------------------------------------------------------------
def test_prompt_shapes() -> None:
    for ok in ("a", [1, 2], ["a", "b"], [[1], [2, 3]], ["a", [1]]):
        assert CompletionRequest(prompt=ok).prompt == ok
    for bad in (5, None, [[]], [True], ["a", 3], {"a": 1}):
        with pytest.raises(ValidationError, match="must be a string, a list of token ids"):
            CompletionRequest(prompt=bad)


def _model(tokens, max_model_len=64) -> ServedModel:
    return ServedModel(names=("m", "alias"), model_dir="/x", max_model_len=max_model_len, vocab_size=320,
                       tokens=tokens, chat_template=None)


def test_translation_names_the_api_fields(tokens) -> None:
    model = _model(tokens)
    # vLLM reports the first served name whichever one a request used.
    assert model.resolve(None) == "m" and model.resolve("alias") == "m"
    with pytest.raises(APIError) as e:
        model.resolve("other")
    assert e.value.status == 404
    with pytest.raises(APIError) as e:
        model.chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                                logprobs=True, top_logprobs=21), 3)
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError) as e:
        model.completion_params(CompletionRequest(prompt="x", echo=True, logprobs=30), 1)
    assert (e.value.param, e.value.message) == (
        "logprobs", "logprobs: Requested sample logprobs of 30, which is greater than max allowed: 20 (--max-logprobs)")
    params = model.completion_params(CompletionRequest(prompt="x", echo=True, max_tokens=0), 1)
    assert (params.max_new_tokens, params.prompt_logprobs) == (0, 0)
    params = model.completion_params(CompletionRequest(prompt="x", max_tokens=None, top_k=-1, stop="s"), 10)
    assert (params.max_new_tokens, params.top_k, params.stop, params.temperature) == (54, 0, ("s",), 1.0)
    params = model.chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), 60)
    assert params.max_new_tokens == 4 and params.logprobs is None
    with pytest.raises(APIError) as e:
        model.render_chat([], add_generation_prompt=True, tools=None, kwargs=None)
    assert "no chat template" in e.value.message and e.value.param == "messages"


def test_generation_defaults(tmp_path) -> None:
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}))
    d = GenerationDefaults.from_model_dir(tmp_path)
    assert d.overrides() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    model = ServedModel(("m",), "/x", 64, 320, None, None, d)
    p = model.completion_params(CompletionRequest(prompt=[1], temperature=0.1), 1)
    assert (p.temperature, p.top_p, p.top_k) == (0.1, 0.95, 20)


def test_body_limit_on_a_chunked_upload() -> None:
    async def echo(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await JSONResponse({"got": len(body)})(scope, receive, send)

    app = BodyLimit(echo, max_bytes=1000)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async def chunks(n):
            for _ in range(n):
                yield b"x" * 300

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/", content=chunks(3)), await c.post("/", content=chunks(4))

    small, big = asyncio.run(run())
    assert small.json() == {"got": 900}
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_served_connections_send_small_writes_at_once(host) -> None:
    """uvicorn serves on bind()'s socket through asyncio, which turns Nagle's algorithm off only on
    sockets that say IPPROTO_TCP: with it on, each streamed chunk waited for the client's delayed ACK."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    listening = bind(host, 0)
    nodelay: list[int] = []

    async def main() -> None:
        def accepted(reader, writer) -> None:
            nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
        server = await asyncio.start_server(accepted, sock=listening)
        async with server:
            port = listening.getsockname()[1]
            for _ in range(2):
                reader, writer = await asyncio.open_connection(host, port)
                await reader.read()
                writer.close()

    asyncio.run(main())
    assert nodelay == [1, 1]


def test_the_server_runs_on_uvloop_and_says_when_it_cannot(monkeypatch, caplog) -> None:
    """run_server (every `l3worker serve` process, ServerThread) runs uvloop's loop; without uvloop,
    asyncio's, with a log line that says so."""
    loops: list[str] = []

    async def which_loop() -> None:
        loops.append(type(asyncio.get_running_loop()).__module__)

    run_server(which_loop())
    monkeypatch.setitem(sys.modules, "uvloop", None)  # its import now fails
    with caplog.at_level(logging.INFO, logger="l3worker.serving"):
        run_server(which_loop())
    assert loops[0].startswith("uvloop") and loops[1].startswith("asyncio")
    assert "uvloop is not installed" in caplog.text
