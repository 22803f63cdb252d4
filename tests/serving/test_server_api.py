"""The OpenAI-compatible API on a real server (uvicorn on a free loopback port, the real engine, the
built-in tiny model), driven by the official openai client and by raw httpx for exact bytes.
One server for the module, with an API key so that every call also proves the key is accepted."""
from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from l3worker import DistributedWorker, SamplingParams
from l3worker.serving.runner import ServeOptions, ServerThread
from server_helpers import leave_mid_stream, metric, sse_events, stream_raw, wait_until

KEY = "test-key-123"
WORKER = dict(max_batch_size=4, max_seq_len=1024, page_size=16)
METRICS = ("l3worker:num_requests_running", "l3worker:num_requests_waiting", "l3worker:kv_cache_usage_perc",
           "l3worker:prompt_tokens_total", "l3worker:generation_tokens_total", "l3worker:request_success_total",
           "l3worker:time_to_first_token_seconds", "l3worker:inter_token_latency_seconds",
           "l3worker:e2e_request_latency_seconds", "l3worker:request_queue_time_seconds")


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(DistributedWorker(None, **WORKER), options=ServeOptions(port=0, api_key=KEY))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def ref():
    """An offline worker of the same configuration: what the server must reproduce."""
    with DistributedWorker(None, **WORKER) as w:
        yield w


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text
    return body["error"]


# -- models, health, metrics, tokenizer ----------------------------------------------------------------
def test_models_lists_the_served_model(oai, server) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == ["l3worker-tiny"]
    assert models[0].object == "model" and models[0].owned_by == "l3worker"
    assert models[0].model_extra["max_model_len"] == 1024


def test_health_and_metrics_need_no_key(server) -> None:
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in METRICS:
        assert f"\n{name}" in r.text, name


def test_tokenize_and_detokenize(http) -> None:
    r = http.post("/tokenize", json={"prompt": "hi!", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 1024, "tokens": [104, 105, 33], "token_strs": ["h", "i", "!"]}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == 257 and chat["tokens"][-3:] == list(b"nt\n")  # <|im_start|> ... assistant\n
    assert http.post("/detokenize", json={"tokens": [104, 105, 257]}).json() == {"prompt": "hi<|im_start|>"}
    assert http.get("/tokenizer_info").status_code == 404  # only with --enable-tokenizer-info-endpoint
    assert error_of(http.post("/detokenize", json={"tokens": [5000]}), 400)["param"] == "tokens"
    assert error_of(http.post("/tokenize", json={}), 400)["param"] == "prompt"


# -- completions ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["The capital of France is", [5, 80, 17, 200, 3, 3, 9]])
def test_greedy_completion_is_exactly_worker_generate(oai, ref, prompt) -> None:
    expected = ref.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20))[0]
    got = oai.completions.create(model="l3worker-tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == "l3worker-tiny"
    assert len(got.choices) == 1
    c = got.choices[0]
    assert (c.index, c.text, c.finish_reason) == (0, expected.text, expected.finish_reason)
    assert c.logprobs is None
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("fields", [
    dict(stop=["V"]),
    dict(stop="V", include_stop_str_in_output=True),
    dict(stop_token_ids=[86]),
    dict(ignore_eos=True),
    dict(min_tokens=26),
    dict(temperature=0.8, top_p=0.9, top_k=50, seed=5),
    dict(temperature=0.8, min_p=0.1, seed=5),
    dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    dict(skip_special_tokens=False),
])
def test_completion_fields_reach_the_engine(oai, ref, fields) -> None:
    params = {k: tuple(v) if isinstance(v, list) else ((v,) if k == "stop" else v) for k, v in fields.items()}
    expected = ref.generate("Hello world", SamplingParams(max_new_tokens=28, **{"temperature": 0.0, **params}))[0]
    got = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=28, temperature=0,
                                 extra_body=fields)
    c = got.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == \
        (expected.text, expected.finish_reason, expected.stop_reason)
    assert got.usage.completion_tokens == len(expected.token_ids)


def test_stop_string_ends_the_text(oai) -> None:
    full = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=24, temperature=0)
    assert "V" in full.choices[0].text
    got = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=24, temperature=0, stop="V")
    c = got.choices[0]
    assert c.text == full.choices[0].text.split("V")[0]
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", "V")


def test_streamed_deltas_concatenate_to_the_whole_text(http) -> None:
    body = {"prompt": "Hello world", "max_tokens": 24, "temperature": 0, "stop": ["V"]}
    whole = http.post("/v1/completions", json=body).json()
    r, raw = stream_raw(http, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(raw)
    chunks, usage_chunk = events[:-2], events[-2]
    assert {c["id"] for c in chunks + [usage_chunk]} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1]["choices"][0]["stop_reason"] == "V"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert usage_chunk["choices"] == [] and _counts(usage_chunk["usage"]) == _counts(whole["usage"])


def test_a_requests_stream_interval_sends_its_tokens_three_a_chunk(http) -> None:
    body = {"prompt": "Hello world", "max_tokens": 11, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(stream_raw(http, "/v1/completions", body | {"stream": True, "stream_interval": 3})[1])
    chunks = [c["choices"][0] for c in events[:-1]]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 3, 3, 3, 1]  # the first at once, the rest 3 a chunk
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_stream_without_usage_has_no_usage_field(oai) -> None:
    chunks = list(oai.completions.create(model="l3worker-tiny", prompt="abc", max_tokens=5, temperature=0,
                                         stream=True))
    assert all(c.usage is None and "usage" not in c.model_fields_set for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_several_prompts_and_n(oai, ref) -> None:
    prompts = ["abc", "Hello world"]
    got = oai.completions.create(model="l3worker-tiny", prompt=prompts, max_tokens=6, n=2, temperature=0.7, seed=9,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    expected = ref.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=0.7, seed=9, ignore_eos=True))
    assert [c.text for c in got.choices] == [s.text for e in expected for s in e.outputs]
    assert got.usage.prompt_tokens == 3 + 11 and got.usage.completion_tokens == 4 * 6
    stream = oai.completions.create(model="l3worker-tiny", prompt=prompts, max_tokens=6, n=2, temperature=0.7,
                                    seed=9, stream=True, extra_body={"ignore_eos": True})
    texts = {i: "" for i in range(4)}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            assert c.index not in finished
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3} and [texts[i] for i in range(4)] == [c.text for c in got.choices]


def test_seeds_are_reproducible(oai) -> None:
    def sample(seed: int) -> str:
        return oai.completions.create(model="l3worker-tiny", prompt="Once upon a time", max_tokens=16,
                                      temperature=1.0, seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_echo_prepends_the_prompt(oai) -> None:
    got = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=4, temperature=0, echo=True)
    plain = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=4, temperature=0)
    assert got.choices[0].text == "Hello world" + plain.choices[0].text
    streamed = oai.completions.create(model="l3worker-tiny", prompt=[72, 105], max_tokens=4, temperature=0,
                                      echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith("Hi")


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_renders_the_template_and_matches_worker_generate(oai, http, ref) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    expected = ref.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    got = oai.chat.completions.create(model="l3worker-tiny", messages=messages, max_completion_tokens=12,
                                      temperature=0)
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    c = got.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", expected.text,
                                                                    expected.finish_reason)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(expected.token_ids)


def test_chat_template_kwargs_reach_the_template(oai) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plain = oai.chat.completions.create(model="l3worker-tiny", messages=messages, max_tokens=2, temperature=0)
    no_think = oai.chat.completions.create(model="l3worker-tiny", messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # <think>, \n, \n, </think>, \n, \n: the empty think block Qwen3's template opens the turn with
    assert no_think.usage.prompt_tokens == plain.usage.prompt_tokens + 6
    bare = oai.chat.completions.create(model="l3worker-tiny", messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == plain.usage.prompt_tokens - 11  # <|im_start|> and "assistant\n"


def test_chat_content_parts_are_joined(oai) -> None:
    parts = oai.chat.completions.create(
        model="l3worker-tiny", max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    joined = oai.chat.completions.create(model="l3worker-tiny", max_tokens=2, temperature=0,
                                         messages=[{"role": "user", "content": "a\nb"}])
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content


def _counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_chat_stream_shape(http) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 10, "temperature": 0,
            "extra": "ignored"}
    whole = http.post("/v1/chat/completions", json=body).json()
    r, raw = stream_raw(http, "/v1/chat/completions",
                        body | {"stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    chunks, last = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (len(chunks) - 1) + [whole["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert last["choices"] == [] and _counts(last["usage"]) == _counts(whole["usage"])
    # The same prompt a second time: its full pages came from the prefix cache.
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= whole["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def test_chat_with_openai_stream_n(oai) -> None:
    stream = oai.chat.completions.create(model="l3worker-tiny", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=5, n=2, temperature=0, stream=True)
    texts, roles = {0: "", 1: ""}, set()
    for chunk in stream:
        for c in chunk.choices:
            roles.add((c.index, c.delta.role)) if c.delta.role else None
            texts[c.index] += c.delta.content or ""
    assert roles == {(0, "assistant"), (1, "assistant")} and texts[0] == texts[1]


# -- logprobs ------------------------------------------------------------------------------------------
def test_completion_logprobs_shape(oai) -> None:
    got = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=6, temperature=0,
                                 logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    # up to 3 entries and the chosen token; fewer where tokens read the same (lone bytes read as U+FFFD)
    assert all(1 <= len(top) <= 4 and top[tok] == v for top, tok, v in zip(lp.top_logprobs, lp.tokens,
                                                                             lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: the chosen token is the most likely one
    assert all(v == max(top.values()) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_echo_logprobs_with_zero_max_tokens_scores_the_prompt(oai) -> None:
    got = oai.completions.create(model="l3worker-tiny", prompt="Hello world", max_tokens=0, echo=True, logprobs=1)
    c = got.choices[0]
    assert c.text == "Hello world" and got.usage.completion_tokens == 0
    assert c.logprobs.tokens == list("Hello world")
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert c.logprobs.text_offset == list(range(11))


def test_chat_logprobs_shape(oai) -> None:
    got = oai.chat.completions.create(model="l3worker-tiny", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
    streamed = oai.chat.completions.create(model="l3worker-tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                           extra_body={"ignore_eos": True})
    entries = [e for c in streamed for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]


# -- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature must be"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be in [1, 64]"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1024}, "max_tokens", "maximum context length is 1024"),
    ("/v1/completions", {"prompt": [1] * 1024, "max_tokens": 1}, "prompt", "1024 in the prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": ""}, "prompt", "prompt: the prompt is empty"),
    ("/v1/completions", {"prompt": [1, 320]}, "prompt", "token id 320 outside [0, 320)"),
    ("/v1/completions", {"prompt": 5}, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 40}, "min_tokens", "max_tokens=16"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [999]}, "stop_token_ids", "999 outside"),
    ("/v1/completions", {"prompt": "x", "stream_interval": 0}, "stream_interval", "stream_interval must be >= 1"),
    ("/v1/completions", {}, "prompt", "Field required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "requires logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
     "max_completion_tokens", "maximum context length is 1024"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "'image_url' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
])
def test_invalid_requests_are_400_naming_the_field(http, path, body, param, needle) -> None:
    err = error_of(http.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"], err


def test_malformed_json_is_400(http) -> None:
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in error_of(r, 400)["message"]


def test_unknown_model_is_404(oai, http) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.status_code == 404
    err = error_of(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "x"}]}), 404)
    # vLLM's body: its NotFoundError, the field, and the status as the code
    assert err == {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": "model",
                   "code": 404}


def test_api_key_is_required(server) -> None:
    with httpx.Client(base_url=server.url) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            err = error_of(c.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        error_of(c.get("/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_oversized_body_is_413(server, http) -> None:
    """Refused from Content-Length, before any of the body is read (the chunked case: test_server_units)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 17000000\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "16777216 bytes" in err["message"]
    assert http.get("/health").status_code == 200


def test_internal_error_is_500_without_details(server, http, monkeypatch) -> None:
    def broken(req):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.model, "completion_prompts", broken)
    err = error_of(http.post("/v1/completions", json={"prompt": "x"}), 500)
    assert err["type"] == "server_error" and "secret" not in err["message"]


# -- disconnects ---------------------------------------------------------------------------------------
def test_client_gone_mid_stream_aborts_the_request(http) -> None:
    aborted = metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
    body = {"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    leave_mid_stream(http, "/v1/completions", body)
    wait_until(lambda: metric(http, "l3worker:num_requests_running") == 0, what="no request running")
    wait_until(lambda: metric(http, "l3worker:request_success_total", 'finished_reason="abort"') == aborted + 1,
               what="the request aborted")
    wait_until(lambda: metric(http, "l3worker:kv_cache_usage_perc") == 0, what="KV pages free")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["Hello", [72, 105]], "n": 2}),  # four engine streams, merged
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
], ids=["completions-two-prompts-n2", "chat"])
def test_client_gone_mid_stream_aborts_every_request(http, path, body) -> None:
    aborted = metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
    body = body | {"max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    leave_mid_stream(http, path, body)
    requests = 2 if "prompt" in body else 1  # an engine request per prompt; its n samples are in it
    wait_until(lambda: metric(http, "l3worker:num_requests_running") == 0, what="no request running")
    wait_until(lambda: metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
               == aborted + requests, what="every request aborted")
    wait_until(lambda: metric(http, "l3worker:kv_cache_usage_perc") == 0, what="KV pages free")


def test_client_gone_before_the_answer_aborts_the_request(server, http) -> None:
    aborted = metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
    body = json.dumps({"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        wait_until(lambda: metric(http, "l3worker:num_requests_running") == 1, what="the request running")
    wait_until(lambda: metric(http, "l3worker:request_success_total", 'finished_reason="abort"') == aborted + 1,
               what="the request aborted")
    wait_until(lambda: metric(http, "l3worker:num_requests_running") == 0, what="no request running")
