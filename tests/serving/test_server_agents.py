"""Reasoning, tool calls and API fidelity on a real server over a checkpoint whose greedy output is
known (tests/scripted_model.py), driven by the official openai client and raw httpx: one server
with --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes
--enable-tokenizer-info-endpoint for the module."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from l3worker import DistributedWorker, SamplingParams
from l3worker.serving.openai.chat import ChatTemplate
from l3worker.serving.openai.chat_reply import ChatParsing
from l3worker.serving.runner import ServeOptions, ServerThread
from scripted_model import (CALL, CALL_ARGUMENTS, EOS_TOKEN, NO_THINK_END, PROBE, PROBE_NEXT, PROBE_TWIN,
                            REASONING, REPLY_NO_THINK, REPLY_OPENED, REPLY_TOOL, THINK_OPEN, THINK_OPEN_TEMPLATE,
                            TOOLS, write_scripted_model)
from server_helpers import sse_events, stream_raw

WORKER = dict(max_batch_size=4, max_seq_len=2048, page_size=64)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_scripted_model(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def server(model_dir):
    options = ServeOptions(port=0, served_model_names=("scripted",), reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True,
                           enable_tokenizer_info_endpoint=True)
    with ServerThread(DistributedWorker(str(model_dir), **WORKER), options=options) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def think_open_template(server):
    """The server renders a template whose generation prompt opens <think> for one test."""
    model = server.model
    saved = model.chat_template
    model.chat_template = ChatTemplate(THINK_OPEN_TEMPLATE, saved.special_tokens)
    yield
    model.chat_template = saved


def chat(oai: openai.OpenAI, **kw):
    return oai.chat.completions.create(model="scripted", messages=kw.pop("messages", USER), temperature=0, **kw)


def streamed(oai: openai.OpenAI, **kw) -> dict:
    """A streamed chat reply accumulated the way an OpenAI client does, with every chunk kept."""
    chunks = list(chat(oai, stream=True, **kw))
    reasoning = content = ""
    calls: dict[int, dict] = {}
    for c in chunks[1:]:  # the first chunk opens the role
        d = c.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "type": tc.type, "name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    return {"chunks": chunks, "reasoning": reasoning or None, "content": content or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": chunks[-1].choices[0].finish_reason}


# -- the checkpoint ------------------------------------------------------------------------------------
def test_transformers_greedy_writes_the_scripted_replies(model_dir) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, want in (("hi\n", REPLY_TOOL + EOS_TOKEN), ("x" + NO_THINK_END, REPLY_NO_THINK + EOS_TOKEN),
                         ("x" + THINK_OPEN, REPLY_OPENED + EOS_TOKEN)):
        ids = tok.encode(prompt).ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert tok.decode(out, skip_special_tokens=False) == want
    logits = model(torch.tensor([[ord(PROBE), PROBE_TWIN]])).logits[0]
    assert int(logits[0].argmax()) == PROBE_NEXT  # after "Q" the greedy token is 0xE5, not 0xE4


def test_offline_generate_writes_them_and_stops_before_the_length_limit(model_dir) -> None:
    with DistributedWorker(str(model_dir), **WORKER) as w:
        whole, cut = w.generate(["hi\n", "hi\n"], [SamplingParams(temperature=0.0, max_new_tokens=32),
                                                   SamplingParams(temperature=0.0, max_new_tokens=2, stop=("weather",))])
    assert (whole.text, whole.finish_reason) == (REPLY_TOOL, "stop")
    # the stop string is completed by the last token max_new_tokens allows: "stop", not "length"
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("<think>\nThe user wants the ", "stop", "weather")


# -- reasoning and tool calls ------------------------------------------------------------------------
def test_tool_call_with_reasoning(oai) -> None:
    reply = chat(oai, tools=TOOLS)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert c.message.model_extra["reasoning_content"] == c.message.model_extra["reasoning"] == REASONING
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert (call.function.name, call.function.arguments) == ("get_weather", CALL_ARGUMENTS)
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_streamed_in_openais_shape(oai, http) -> None:
    got = streamed(oai, tools=TOOLS, tool_choice="auto")
    assert (got["reasoning"], got["content"], got["finish"]) == (REASONING, None, "tool_calls")
    (call,) = got["calls"]
    assert (call["type"], call["name"], call["arguments"]) == ("function", "get_weather", CALL_ARGUMENTS)
    assert call["id"].startswith("call_")
    # raw bytes: the first delta of a call carries index, id, type, name and empty arguments; later
    # ones only the index and argument fragments
    r, raw = stream_raw(http, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "temperature": 0,
                                                       "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(raw)[:-1]]
    entries = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first, *rest = entries
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest)
    assert "".join(e["function"]["arguments"] for e in rest) == CALL_ARGUMENTS
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_tool_choice_none_parses_nothing(oai) -> None:
    reply = chat(oai, tools=TOOLS, tool_choice="none")
    c = reply.choices[0]
    assert (c.finish_reason, c.message.tool_calls) == ("stop", None)
    assert c.message.content == "\n\n<tool_call>\n" + CALL + "\n</tool_call>"
    assert c.message.model_extra["reasoning_content"] == REASONING
    got = streamed(oai, tools=TOOLS, tool_choice="none")
    assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == \
        (REASONING, c.message.content, [], "stop")


def test_tools_without_auto_tool_choice_are_refused(server, http) -> None:
    saved = server.model.parsing
    server.model.parsing = ChatParsing(reasoning_parser="qwen3")  # as a server without --enable-auto-tool-choice
    try:
        r = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
        none = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none",
                                                       "max_tokens": 1})
    finally:
        server.model.parsing = saved
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert none.status_code == 200


def test_multi_turn_history_with_tool_results_reaches_the_template(oai, http) -> None:
    first = chat(oai, tools=TOOLS).choices[0].message
    history = USER + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"sky": "sunny"}'}]
    rendered = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert "<tool_call>\n" + CALL + "\n</tool_call><|im_end|>" in text  # the assistant's call, arguments as JSON
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n'
                         "<|im_start|>assistant\n")
    reply = chat(oai, tools=TOOLS, messages=history)
    assert reply.usage.prompt_tokens == rendered["count"]
    assert reply.choices[0].finish_reason == "tool_calls"  # this model always calls after its opening


def test_enable_thinking_false_gives_content_only(oai) -> None:
    c = chat(oai, tools=TOOLS, extra_body=NO_THINK).choices[0]
    assert (c.message.content, c.message.model_extra["reasoning_content"], c.message.tool_calls, c.finish_reason) == \
        (REPLY_NO_THINK, None, None, "stop")
    got = streamed(oai, tools=TOOLS, extra_body=NO_THINK)
    assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == (None, REPLY_NO_THINK, [], "stop")


def test_a_prompt_that_opens_the_think_block(oai, think_open_template) -> None:
    reasoning, content = "The tool said it is sunny.\n", "\n\nSunny, 22 degrees."
    assert REPLY_OPENED == reasoning + "</think>" + content
    c = chat(oai).choices[0]
    assert (c.message.model_extra["reasoning"], c.message.content, c.finish_reason) == (reasoning, content, "stop")
    got = streamed(oai)
    assert (got["reasoning"], got["content"], got["finish"]) == (reasoning, content, "stop")


def test_a_think_block_cut_by_max_tokens_is_all_reasoning(oai) -> None:
    c = chat(oai, tools=TOOLS, max_tokens=2).choices[0]
    assert (c.message.model_extra["reasoning_content"], c.message.content, c.message.tool_calls, c.finish_reason) == \
        (REASONING, None, None, "length")
    got = streamed(oai, tools=TOOLS, max_tokens=2)
    assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == (REASONING, None, [], "length")


def test_each_streamed_choice_is_parsed_on_its_own(oai) -> None:
    chunks = list(chat(oai, tools=TOOLS, n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        names = [tc.function.name for ch in mine for tc in ch.delta.tool_calls or [] if tc.function.name]
        reasoning = "".join((ch.delta.model_extra or {}).get("reasoning_content") or "" for ch in mine)
        assert (names, reasoning, mine[-1].finish_reason) == (["get_weather"], REASONING, "tool_calls")


# -- API fidelity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_last_allowed_token_stops(oai, stream) -> None:
    kw = dict(model="scripted", prompt="go\n", max_tokens=2, stop=["weather"], temperature=0)
    if stream:
        chunks = list(oai.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        last = oai.completions.create(**kw).choices[0]
        text = last.text
    assert (text, last.finish_reason, last.model_extra["stop_reason"]) == \
        ("<think>\nThe user wants the ", "stop", "weather")


def _is_greedy(choice: dict, ctxlen: int) -> bool:
    """lm-eval's is_greedy for an echoed completion (openai_completions.parse_logprobs)."""
    lp = choice["logprobs"]
    return all(tok == max(top.values())
               for tok, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))


@pytest.mark.parametrize("as_ids", [False, True])
def test_top_logprobs_never_pass_a_non_greedy_token_for_greedy(http, as_ids) -> None:
    # After "Q" the model writes 0xE5; the prompt has 0xE4 there. Both read as U+FFFD.
    body = {"prompt": [ord(PROBE), PROBE_TWIN], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0,
            "return_tokens_as_token_ids": as_ids}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert not _is_greedy(choice, ctxlen=1)  # transformers' argmax there is 0xE5
    top = choice["logprobs"]["top_logprobs"][1]
    if as_ids:
        assert choice["logprobs"]["tokens"][:2] == [f"token_id:{ord(PROBE)}", f"token_id:{PROBE_TWIN}"]
        assert set(top) == {f"token_id:{PROBE_NEXT}", f"token_id:{PROBE_TWIN}"}
        assert max(top, key=top.get) == f"token_id:{PROBE_NEXT}"
    else:
        assert choice["logprobs"]["tokens"][:2] == [PROBE, "\ufffd"] and list(top) == ["\ufffd"]
    # the greedy continuation is greedy
    greedy = http.post("/v1/completions", json={**body, "prompt": [ord(PROBE), PROBE_NEXT]}).json()["choices"][0]
    assert _is_greedy(greedy, ctxlen=1)


@pytest.mark.parametrize("include", [False, True])
def test_the_eos_text_is_left_out_unless_asked(oai, include) -> None:
    c = oai.completions.create(model="scripted", prompt="x" + NO_THINK_END, max_tokens=8, temperature=0,
                               extra_body={"skip_special_tokens": False, "include_stop_str_in_output": include})
    want = REPLY_NO_THINK + (EOS_TOKEN if include else "")
    assert (c.choices[0].text, c.choices[0].finish_reason) == (want, "stop")


def test_tokenizer_info_serves_what_a_remote_tokenizer_needs(http, model_dir) -> None:
    info = http.get("/tokenizer_info").json()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert info["eos_token"] == EOS_TOKEN and info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == config["chat_template"] and info["model_max_length"] == 2048
    # lm-eval's RemoteTokenizer: eos_token_id is the first id /tokenize gives for eos_token
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [json.loads((model_dir / "config.json").read_text())["eos_token_id"]]
