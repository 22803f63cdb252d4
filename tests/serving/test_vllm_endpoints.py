"""The endpoints and server flags a vLLM client relies on, on real servers (in this process, on
loopback): the model served under the name it was given, vLLM's 404 body, /v1/models' fields,
/tokenize and /detokenize, /version, /ping, several API keys, --seed, --max-logprobs,
--response-role, --enable-log-requests, the throughput line, CORS, --served-model-name aliases,
--root-path, --generation-config FOLDER and TLS."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess

import httpx
import openai
import pytest

from chip_child.models.tiny_model import ensure_tiny_model
from l3worker import DistributedWorker
from l3worker.serving.openai.generation_config import GenerationDefaults, RequestSeeds
from l3worker.serving.openai.protocol import CompletionRequest
from l3worker.serving.runner import ServeOptions, ServerThread
from server_helpers import sse_events, stream_raw, wait_until

WORKER = dict(max_batch_size=2, max_seq_len=256, page_size=16)
KEYS = ["key-one", "key-two"]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def server(tiny):
    """`l3worker serve /path/to/tiny --api-key key-one key-two --seed 7 --max-logprobs 2
    --response-role bot --enable-log-requests`."""
    options = ServeOptions(port=0, api_key=KEYS, seed=7, max_logprobs=2, response_role="bot",
                           enable_log_requests=True, stats_interval_s=0.05)
    with ServerThread(DistributedWorker(tiny, **WORKER), options=options) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=60) as c:
        yield c


def test_the_model_is_listed_under_its_name_as_typed_with_vllms_fields(server, http, tiny) -> None:
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": tiny, "object": "model", "owned_by": "l3worker", "root": tiny, "parent": None, "max_model_len": 256}
    assert isinstance(card["created"], int)
    [perm] = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert (perm["allow_sampling"], perm["allow_logprobs"], perm["organization"]) == (True, True, "*")
    listed = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0).models.list().data
    assert [m.id for m in listed] == [tiny]  # the second key is as good as the first


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
])
def test_a_model_not_served_gets_vllms_404_body(http, path, body) -> None:
    r = http.post(path, json={**body, "model": "Qwen/Qwen3-0.6B"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `Qwen/Qwen3-0.6B` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}


def test_tokenize_and_detokenize_take_and_give_vllms_fields(server, http, tiny) -> None:
    tokens = server.model.tokens
    r = http.post("/tokenize", json={"model": tiny, "prompt": "hello there", "return_token_strs": True}).json()
    ids = tokens.encode("hello there", add_special_tokens=True)
    assert r == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                 "token_strs": [tokens.token_text(t) for t in ids]}
    assert http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    chat = http.post("/tokenize", json={"model": tiny, "messages": messages[:1]}).json()
    text = server.model.chat_template.render(messages[:1], add_generation_prompt=True)
    assert chat["tokens"] == tokens.encode(text) and chat["count"] == len(chat["tokens"])
    # continue_final_message: the prompt ends inside the last message, for the model to continue it
    cont = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()["tokens"]
    closed = server.model.chat_template.render(messages, add_generation_prompt=False)
    assert tokens.decode(cont) == closed[:closed.rindex("Hel") + 3] and not closed.endswith("Hel")
    both = http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert http.post("/detokenize", json={"model": tiny, "tokens": ids}).json() == {"prompt": "hello there"}


def test_version_ping_and_health_answer_without_a_key(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/version").json()["version"]
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").status_code == 401


def test_requests_without_a_seed_draw_theirs_from_the_servers_seed(server, http, caplog) -> None:
    server.model.seeds = RequestSeeds(7)  # from the start of the sequence, whatever ran before
    expected = RequestSeeds(7).next()
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="l3worker.serving.received"):
        drawn = http.post("/v1/completions", json=body).json()
    received = [r.getMessage() for r in caplog.records if r.name == "l3worker.serving.received"]
    assert len(received) == 1 and received[0].startswith("Received request cmpl-")
    assert f"seed={expected}," in received[0] and "temperature=1.0" in received[0]  # --enable-log-requests
    again = http.post("/v1/completions", json={**body, "seed": expected}).json()
    assert drawn["choices"][0]["text"] == again["choices"][0]["text"]


def test_more_logprobs_than_max_logprobs_is_a_400(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "greater than max allowed: 2" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "logprobs": True,
                                                 "top_logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 2}).json()
    assert len(ok["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    assert http.get("/health").status_code == 200  # still serving


def test_chat_replies_take_the_response_role(http) -> None:
    whole = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert whole["choices"][0]["message"]["role"] == "bot"
    _, raw = stream_raw(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True})
    assert sse_events(raw)[0]["choices"][0]["delta"]["role"] == "bot"
    # without a generation prompt the reply continues the last message, in its role (vLLM's rule)
    cont = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                                                    "add_generation_prompt": False}).json()
    assert cont["choices"][0]["message"]["role"] == "user"


def test_the_throughput_line_is_logged_while_requests_run(http, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="l3worker.serving.stats"):
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        wait_until(lambda: any(r.name == "l3worker.serving.stats" for r in caplog.records), 30, "a stats line")
    line = next(r.getMessage() for r in caplog.records if r.name == "l3worker.serving.stats")
    assert line.startswith("Avg prompt throughput: ") and "Running: " in line and "KV cache usage: " in line


def test_cors_answers_preflights_for_any_origin_by_default(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        pre = c.options("/v1/completions", headers={"origin": "http://app.example",
                                                    "access-control-request-method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        got = c.get("/v1/models", headers={"origin": "http://app.example", "authorization": f"Bearer {KEYS[0]}"})
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "*"


# -- a second server: aliases, --root-path, CORS origins, --generation-config FOLDER, TLS ------------------
@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True,
                   capture_output=True)
    return d / "key.pem", d / "cert.pem"


@pytest.fixture(scope="module")
def aliased(tmp_path_factory, tls):
    """`l3worker serve --served-model-name alpha beta --root-path /api --api-key k --allowed-origins
    '["http://ok.example"]' --generation-config FOLDER --ssl-keyfile K --ssl-certfile C`."""
    folder = tmp_path_factory.mktemp("gen")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    options = ServeOptions(port=0, served_model_names=("alpha", "beta"), root_path="/api", api_key="k",
                           allowed_origins=("http://ok.example",), generation_config=str(folder),
                           ssl_keyfile=str(tls[0]), ssl_certfile=str(tls[1]), disable_log_stats=True)
    with ServerThread(DistributedWorker(None, **WORKER), options=options) as srv:
        yield srv, folder


def test_served_names_are_aliases_and_the_first_is_reported(aliased) -> None:
    srv, _ = aliased
    assert srv.url.startswith("https://127.0.0.1:")
    with httpx.Client(base_url=srv.url, verify=False, timeout=60, headers={"authorization": "Bearer k"}) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["alpha", "beta"]
        done = c.post("/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 1}).json()
        assert done["model"] == "alpha"
        assert c.post("/v1/completions", json={"model": "gamma", "prompt": "x"}).status_code == 404
    # --root-path: a proxy strips the prefix, so the routes answer at their own paths, the open ones
    # without the key though the server sees them under the prefix
    with httpx.Client(base_url=srv.url, verify=False, timeout=60) as c:
        assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200
        assert c.get("/v1/models").status_code == 401
    with pytest.raises(httpx.HTTPError):  # TLS only
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)


def test_cors_origins_are_the_ones_allowed(aliased) -> None:
    srv, _ = aliased
    with httpx.Client(base_url=srv.url, verify=False, timeout=30) as c:
        pre = {"access-control-request-method": "POST"}
        ok = c.options("/v1/completions", headers={"origin": "http://ok.example", **pre})  # no key: a preflight
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"
        bad = c.options("/v1/completions", headers={"origin": "http://evil.example", **pre})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_generation_config_folder_gives_the_sampling_defaults(aliased) -> None:
    srv, folder = aliased
    defaults = srv.model.defaults
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    assert defaults.describe() == f"sampling defaults temperature=0.6 top_p=0.95 top_k=20 from " \
                                  f"{folder / 'generation_config.json'}"
    params = srv.model.completion_params(CompletionRequest(prompt=[1]), 1)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    params = srv.model.completion_params(CompletionRequest(prompt=[1], temperature=0), 1)
    assert (params.temperature, params.top_p) == (0.0, 0.95)  # only the fields the request leaves out
    assert GenerationDefaults.for_option("vllm", folder) == GenerationDefaults()
    with pytest.raises(ValueError, match="--generation-config"):
        GenerationDefaults.for_option(str(folder / "nowhere"), folder)

