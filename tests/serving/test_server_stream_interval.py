"""A server started with stream_interval 3 (`--stream-interval 3`): chunks of three tokens, the same
text as a request that does not stream, and a client that leaves mid-stream still frees its row."""
from __future__ import annotations

import httpx
import pytest

from l3worker import DistributedWorker
from l3worker.serving.runner import ServeOptions, ServerThread
from server_helpers import leave_mid_stream, metric, sse_events, stream_raw, wait_until


@pytest.fixture(scope="module")
def http():
    worker = DistributedWorker(None, max_batch_size=4, max_seq_len=512, page_size=16, stream_interval=3)
    with ServerThread(worker, options=ServeOptions(port=0)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def test_chunks_carry_three_tokens_and_add_up_to_the_whole_text(http) -> None:
    body = {"prompt": "Hello world", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(stream_raw(http, "/v1/completions", body | {"stream": True})[1])
    chunks = [c["choices"][0] for c in events[:-1]]
    sizes = [len(c["logprobs"]["tokens"]) for c in chunks]
    assert sum(sizes) == 20 and sizes[0] == 1 and all(size >= 3 for size in sizes[1:-1]), sizes
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_a_client_gone_mid_stream_frees_its_row(http) -> None:
    aborted = metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
    body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    leave_mid_stream(http, "/v1/completions", body)
    wait_until(lambda: metric(http, "l3worker:request_success_total", 'finished_reason="abort"') == aborted + 1,
               what="the request aborted")
    wait_until(lambda: metric(http, "l3worker:kv_cache_usage_perc") == 0, what="KV pages free")
    again = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "temperature": 0,
                                               "ignore_eos": True}).json()
    assert again["usage"]["completion_tokens"] == 5  # the server goes on serving
