"""`l3worker serve --inline-engine`: the engine in the API server's process, stepped by its event
loop. The server then runs beside its chip-child alone, streams the tokens offline generate() gives,
takes aborts, stream_interval, grammars and a child's death mid-stream (the wait handed to the
executor notices it, and the restart resumes every stream), refuses layouts it cannot serve by
name, and a SIGTERM mid-stream leaves nothing behind."""
from __future__ import annotations

import os

import httpx
import psutil
import pytest

from fault_helpers import assert_nothing_left, shm_entries
from l3worker import DistributedWorker
from l3worker.serving.runner import ServeOptions, ServerThread
from server_helpers import (assert_step_core_kept, concurrent_greedy_texts, leave_mid_stream, metric,
                            offline_greedy_texts, sigterm_mid_stream, sse_events, started_processes, stream_raw,
                            wait_until)

SERVE = ("--max-num-seqs", "4", "--max-model-len", "4096", "--block-size", "16")
PROMPTS = [[5 + k, 80, 17, 200 + k, 3, 3, 9] for k in range(5)]  # more than --max-num-seqs: some wait
GREEDY = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
SEEDED = {**GREEDY, "temperature": 0.9, "top_p": 0.9, "seed": 7}


def test_served_inline_on_every_core_its_threads_keep_off_the_step_core(served) -> None:
    s = served("--inline-engine", "--device", "cpu", "--cpu-layout", "every_core", *SERVE)
    line = s.ready()
    assert_step_core_kept(line.string, [psutil.Process(s.proc.pid)], started_processes(s.proc.pid, "chip_child")[0])
    with httpx.Client(base_url=line.group(1), timeout=60) as http:
        text, _ = streamed_text(http, GREEDY)
        assert text == http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]


def streamed_text(http: httpx.Client, body: dict) -> tuple[str, list[dict]]:
    r, raw = stream_raw(http, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(raw)[:-1]
    return "".join(e["choices"][0]["text"] for e in events), events


def test_served_inline_it_runs_beside_its_child_alone_and_gives_offline_tokens(served) -> None:
    s = served("--inline-engine", *SERVE)
    url, _ = s.ready().groups()
    assert not started_processes(s.proc.pid, "l3worker.serving.engine_core")
    assert not started_processes(s.proc.pid, "l3worker.serving.api_server")
    children = started_processes(s.proc.pid, "chip_child")
    assert len(children) == 1

    assert concurrent_greedy_texts(url, PROMPTS, 12) == offline_greedy_texts(PROMPTS, 12, max_batch_size=4,
                                                                             max_seq_len=4096, page_size=16)
    with httpx.Client(base_url=url, timeout=60) as http:
        text, _ = streamed_text(http, GREEDY)
        assert text == http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]

        events = sigterm_mid_stream(s, http, {**GREEDY, "max_tokens": 4000, "stream": True})
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert os.listdir(s.tmpdir) == []


@pytest.mark.parametrize("flags, named", [(("--api-server-count", "2"), "--api-server-count 2"),
                                          (("--data-parallel-size", "2"), "--data-parallel-size")])
def test_layouts_it_cannot_serve_exit_2_naming_the_flag(served, flags, named) -> None:
    s = served("--inline-engine", *SERVE, *flags)
    assert s.proc.wait(60) == 2
    assert any("--inline-engine" in line and named in line for line in s.stderr), s.stderr[-5:]


def test_a_cpu_that_reorders_stores_is_refused_by_name(monkeypatch) -> None:
    """step_ready() reads the doorbell and then the ring with no fence between: x86 only."""
    from l3worker.serving import inline_engine

    monkeypatch.setattr(inline_engine, "ORDERED_STORES", False)
    assert "keeps stores in order" in inline_engine.inline_refusal(1, 1, False)


@pytest.fixture(scope="module")
def server():
    worker = DistributedWorker(None, max_batch_size=2, max_seq_len=4096, page_size=16)
    with ServerThread(worker, options=ServeOptions(port=0), inline=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_an_idle_death_is_repaired_with_no_request_running(server, http) -> None:
    """No step runs to notice it: the loop's liveness check, handed to the executor, does."""
    before = http.post("/v1/completions", json=SEEDED).json()["choices"][0]["text"]
    restarts = metric(http, "l3worker:engine_restarts_total")
    psutil.Process(server.engine.worker.child_pids[0]).kill()
    wait_until(lambda: metric(http, "l3worker:engine_restarts_total") == restarts + 1, 60, "a restart")
    wait_until(lambda: http.get("/health").status_code == 200, 60, "/health 200 again")
    assert http.post("/v1/completions", json=SEEDED).json()["choices"][0]["text"] == before


def test_a_client_gone_mid_stream_frees_its_row(http) -> None:
    aborted = metric(http, "l3worker:request_success_total", 'finished_reason="abort"')
    leave_mid_stream(http, "/v1/completions", {**GREEDY, "max_tokens": 400, "stream": True})
    wait_until(lambda: metric(http, "l3worker:request_success_total", 'finished_reason="abort"') == aborted + 1,
               what="the request aborted")
    wait_until(lambda: metric(http, "l3worker:kv_cache_usage_perc") == 0, what="KV pages free")
    assert http.post("/v1/completions", json={**GREEDY, "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5


def test_a_request_whose_grammar_compiles_off_the_loop_is_served(http) -> None:
    """The grammar compiles in a thread of its own, which tells the event loop when it is done."""
    body = {**GREEDY, "max_tokens": 10, "structured_outputs": {"choice": ["yes", "no"]}}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] in ("yes", "no")


def test_stream_interval_reads_steps_together_with_the_same_text(http) -> None:
    whole = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    text, events = streamed_text(http, {**GREEDY, "stream_interval": 3, "logprobs": 0})
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]
    assert text == whole and sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]), sizes


def test_streams_open_across_a_death_end_as_undisturbed_ones() -> None:
    """Each of the first two generations of children exits at its 21st decode step: the step that
    never completes is handed to the executor, whose wait sees the death, and the engine restarts
    the children and resumes the stream."""
    shm_before = shm_entries()
    worker = DistributedWorker(None, device="cpu", max_batch_size=2, max_seq_len=256, page_size=16, num_threads=1,
                               fault_injection=["exit@20", "exit@20"])
    with ServerThread(worker, inline=True) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        socket_dir, children = worker.socket_dir, [psutil.Process(pid) for pid in worker.child_pids]
        streamed = []
        for body in (GREEDY, SEEDED):
            text, events = streamed_text(http, body)
            assert not any("error" in e for e in events), events[-1]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            streamed.append(text)
            children += [psutil.Process(pid) for pid in worker.child_pids]
        assert metric(http, "l3worker:engine_restarts_total") == 2
        assert streamed == [http.post("/v1/completions", json=body).json()["choices"][0]["text"]
                            for body in (GREEDY, SEEDED)]
    assert_nothing_left(children, socket_dir, shm_before)
