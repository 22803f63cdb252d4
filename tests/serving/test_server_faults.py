"""A checkpoint with no tokenizer and no chat template, then a chip-child killed under a live stream
with restarts off: the server answers 400s that say why, then 503s, and never hangs."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from l3worker import DistributedWorker
from l3worker.serving.runner import ServeOptions, ServerThread
from server_helpers import sse_events, stream_into, wait_until


@pytest.fixture(scope="module")
def server(make_checkpoint):
    path = make_checkpoint("server-bare")  # transformers' save_pretrained: no tokenizer.json, no template
    srv = ServerThread(DistributedWorker(path, max_batch_size=2, max_seq_len=512, page_size=16, max_restarts=0),
                       options=ServeOptions(port=0))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    return r.json()["error"]


def test_served_name_is_the_directory_as_named(server, http) -> None:
    # vLLM's rule: the model argument as given, not the directory's basename
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [str(server.model.model_dir)]


def test_no_chat_template_is_a_400_saying_so(http) -> None:
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert "no chat template" in err["message"] and "--chat-template" in err["message"]


def test_no_tokenizer_means_token_id_prompts(http) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": "text"}), 400)
    assert err["param"] == "prompt" and "no tokenizer" in err["message"]
    r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 4
    # The engine's own check (stop strings need a tokenizer), raised at its first output, is a 400 too.
    err = error_of(http.post("/v1/completions", json={"prompt": [1, 2], "stop": ["x"]}), 400)
    assert "stop strings need a tokenizer" in err["message"]


def test_killed_child_gives_503_and_ends_open_streams(server, http) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    raw: list[bytes] = []
    started = threading.Event()

    reader = stream_into(server.url, body, raw, started)
    assert started.wait(60)
    os.kill(server.engine.worker.child_pids[0], signal.SIGKILL)
    reader.join(60)
    assert not reader.is_alive()
    events = sse_events(b"".join(raw))
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["type"] == "server_error"

    wait_until(lambda: http.get("/health").status_code == 503, what="/health 503")
    err = error_of(http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}), 503)
    assert "engine is dead" in err["message"]
    r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "stream": True})
    error_of(r, 503)
    assert http.get("/metrics").status_code == 200
