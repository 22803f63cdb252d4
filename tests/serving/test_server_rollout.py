"""The RL rollout endpoints over HTTP, in every layout (`l3worker serve` with its engine-core process
or its engine inline, and the in-process AsyncEngine): 404 without --enable-sleep-mode / --enable-weight-updates, 401
without the key; sleep and wake (503 naming sleep meanwhile, the same greedy tokens after; level 2
refuses requests until a weight update); update_weights_from_disk (what a server on the new
checkpoint answers, its weight_version in /v1/models and the responses; another shape is a 400
naming the tensor); pause keep and continue (the stream finishes whole), pause abort (it ends with
finish_reason "abort"); and with two engine cores behind two API servers, a control reaching both
and the new weight_version every API server.

Checkpoints are random tiny Qwen3s without a tokenizer: prompts and answers are token ids
(logprobs tokens as "token_id:N")."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_helpers import Served, sse_events

KEY = "rollout-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SERVE = ("--device", "cpu", "--max-model-len", "512", "--block-size", "16", "--max-num-seqs", "2")
PROMPT = [5, 80, 17, 200, 3, 9]
LONG = 480  # tokens of a stream paused midway: many steps, so that it is still running when paused


def greedy(http: httpx.Client, max_tokens: int = 8) -> tuple[list[int], dict]:
    """The greedy completion's token ids, and the whole body."""
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]], body


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> dict[str, str]:
    return {"a": str(make_checkpoint("rollout-a", seed=0)), "b": str(make_checkpoint("rollout-b", seed=1)),
            "wide": str(make_checkpoint("rollout-wide", seed=2, intermediate_size=128))}


@pytest.fixture(scope="module")
def plain(checkpoints):
    """`l3worker serve B` without the flags: the endpoints are 404, and its answers are B's."""
    s = Served(checkpoints["b"], *SERVE)
    try:
        yield s.ready()[1]
    finally:
        s.stop()


@pytest.fixture(scope="module", params=["engine-core", "inline", "in-process"])
def url(request, checkpoints):
    """A server on A with both flags and an API key: `l3worker serve` (its engine-core process, or
    the engine inline: controls are handed from its event loop to the executor), or a ServerThread
    over a worker in this process (AsyncEngine)."""
    if request.param != "in-process":
        s = Served(checkpoints["a"], *SERVE, "--api-key", KEY, "--enable-sleep-mode", "--enable-weight-updates",
                   *(["--inline-engine"] if request.param == "inline" else []))
        try:
            yield s.ready()[1]
        finally:
            s.stop()
        return
    from l3worker import DistributedWorker
    from l3worker.serving.runner import ServeOptions, ServerThread

    worker = DistributedWorker(checkpoints["a"], device="cpu", max_batch_size=2, max_seq_len=512, page_size=16,
                               enable_sleep_mode=True)
    options = ServeOptions(port=0, api_key=KEY, enable_sleep_mode=True, enable_weight_updates=True)
    with ServerThread(worker, options=options) as srv:
        yield srv.url


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        yield c


ENDPOINTS = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/update_weights_from_disk"),
             ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/reset_prefix_cache")]


def test_the_endpoints_are_404_without_their_flags(plain) -> None:
    with httpx.Client(base_url=plain, timeout=60) as c:
        for method, path in ENDPOINTS:
            r = c.request(method, path, json={"model_path": "x"})
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_endpoints_need_the_api_key(url) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for method, path in ENDPOINTS:
            r = c.request(method, path, json={"model_path": "x"})
            assert r.status_code == 401, (path, r.text)
        assert c.get("/is_sleeping", headers={"authorization": "Bearer wrong"}).status_code == 401


def test_sleep_refuses_requests_with_503_and_wake_up_gives_the_same_tokens(http) -> None:
    before, _ = greedy(http)
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert r.json()["level"] == 1 and r.json()["freed_bytes"] >= 0
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": stream})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_asleep" and "sleeps" in err["message"], err
    r = http.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])
    assert r.status_code == 200, r.text
    assert r.json()["level"] == 0 and r.json()["weights_need_update"] is False
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert greedy(http)[0] == before


def test_sleep_level_2_drops_the_weights_until_an_update_brings_them_back(http, checkpoints) -> None:
    assert http.post("/update_weights_from_disk", json={"model_path": checkpoints["a"]}).status_code == 200
    before, _ = greedy(http)  # A's, whatever ran before
    version = http.get("/v1/models").json()["data"][0]["weight_version"]
    assert http.post("/sleep", params={"level": 2}).json()["level"] == 2
    assert http.post("/wake_up").json()["weights_need_update"] is True
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_asleep", r.text
    assert "update" in r.json()["error"]["message"], r.text
    r = http.post("/update_weights_from_disk", json={"model_path": checkpoints["a"]})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == str(int(version) + 1)  # none given: the count of updates
    assert greedy(http)[0] == before


def test_bad_controls_are_400s_naming_the_field(http) -> None:
    for path, kwargs, word in [("/sleep", {"params": {"level": 3}}, "level"),
                               ("/sleep", {"params": {"level": "deep"}}, "level"),
                               ("/wake_up", {"params": {"tags": "disk"}}, "tags"),
                               ("/pause_generation", {"json": {"mode": "later"}}, "mode"),
                               ("/update_weights_from_disk", {"json": {}}, "model_path")]:
        r = http.post(path, **kwargs)
        assert r.status_code == 400, (path, r.text)
        assert word in r.json()["error"]["message"], r.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_update_weights_from_disk_answers_as_the_new_checkpoint(http, plain, checkpoints) -> None:
    with httpx.Client(base_url=plain, timeout=120) as reference:
        expected, _ = greedy(reference)
    assert greedy(http)[0] != expected  # a different random checkpoint: the update is visible
    r = http.post("/update_weights_from_disk", json={"model_path": checkpoints["b"], "weight_version": "step-7"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weight_version"] == "step-7"
    assert [m["weight_version"] for m in http.get("/v1/models").json()["data"]] == ["step-7"]
    tokens, body = greedy(http)
    assert tokens == expected and body["weight_version"] == "step-7"
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.read())
    finishing = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [e["weight_version"] for e in finishing] == ["step-7"] and events[-2]["weight_version"] == "step-7"
    assert all("weight_version" not in e for e in events[:-1] if e["choices"] and not e["choices"][0]["finish_reason"])


def test_a_checkpoint_of_another_shape_is_a_400_naming_the_tensor(http, checkpoints) -> None:
    version = http.get("/v1/models").json()["data"][0]["weight_version"]
    before, _ = greedy(http)
    r = http.post("/update_weights_from_disk", json={"model_path": checkpoints["wide"]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "mlp.gate_proj.weight" in err["message"], err
    assert http.get("/v1/models").json()["data"][0]["weight_version"] == version  # nothing changed
    assert greedy(http)[0] == before


def _stream(url: str, max_tokens: int, events: list, started: threading.Event) -> threading.Thread:
    """A thread streaming a greedy completion into `events` (the raw bytes, then parsed)."""
    def read() -> None:
        raw = []
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                for chunk in r.iter_raw():
                    raw.append(chunk)
                    events.append(len(raw))
                    started.set()
            events.append(sse_events(b"".join(raw)))
        finally:
            started.set()

    t = threading.Thread(target=read)
    t.start()
    return t


def test_pause_keep_holds_a_stream_and_continue_finishes_it(http, url) -> None:
    progress: list = []
    started = threading.Event()
    reader = _stream(url, LONG, progress, started)
    try:
        assert started.wait(60)
        r = http.post("/pause_generation", json={"mode": "keep"})
        assert r.status_code == 200, r.text
        assert r.json()["num_unfinished_requests"] == 1, "the stream ended before the pause: raise LONG"
        time.sleep(0.3)  # outputs sent before the pause may still be on their way
        seen = len(progress)
        reader.join(0.5)
        assert reader.is_alive() and len(progress) == seen  # held: nothing more came
        assert http.post("/continue_generation").json() == {"success": True}
    finally:
        reader.join(120)
    events = progress[-1]
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [e["choices"][0]["finish_reason"] for e in finals] == ["length"]
    assert events[-2]["usage"]["completion_tokens"] == LONG


def test_pause_abort_ends_a_running_stream_with_finish_reason_abort(http, url) -> None:
    progress: list = []
    started = threading.Event()
    reader = _stream(url, LONG, progress, started)
    try:
        assert started.wait(60)
        r = http.post("/pause_generation")  # mode abort by default
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "mode": "abort", "num_unfinished_requests": 1}
    finally:
        reader.join(60)
        http.post("/continue_generation")
    events = progress[-1]
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [e["choices"][0]["finish_reason"] for e in finals] == ["abort"]
    assert events[-2]["usage"]["completion_tokens"] < LONG
    assert len(greedy(http, 2)[0]) == 2  # it serves again
    assert http.post("/reset_prefix_cache").json()["success"] is True


def test_data_parallel_engines_all_take_a_control_and_every_api_server_learns_the_version(
        checkpoints, plain) -> None:
    """Two engine cores behind two API servers: a control reaches both engines (replies combined),
    and the new weight_version reaches the API server that did not ask too."""
    s = Served(checkpoints["a"], *SERVE, "--data-parallel-size", "2", "--api-server-count", "2",
               "--data-parallel-routing", "round_robin", "--enable-sleep-mode", "--enable-weight-updates")
    try:
        base = s.ready()[1]
        with httpx.Client(base_url=base, timeout=120) as http:
            assert http.post("/sleep").json()["level"] == 1
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 503
            assert http.post("/wake_up").status_code == 200
            r = http.post("/update_weights_from_disk", json={"model_path": checkpoints["b"], "weight_version": "v2"})
            assert r.status_code == 200 and r.json()["weight_version"] == "v2", r.text
        with httpx.Client(base_url=plain, timeout=120) as reference:
            expected, _ = greedy(reference)
        for _ in range(6):  # a new connection each: either API server, either engine
            with httpx.Client(base_url=base, timeout=120, headers={"connection": "close"}) as http:
                assert http.get("/v1/models").json()["data"][0]["weight_version"] == "v2"
                tokens, body = greedy(http)
                assert tokens == expected and body["weight_version"] == "v2"
    finally:
        s.stop()
