"""The server under chip-child faults: a death while idle is noticed and repaired with no request
running, a stream open across a death ends as an undisturbed one does, a full queue answers 503,
SIGTERM ends every open stream with [DONE], and exhausted restarts leave a 503 server that still
exits cleanly. Nothing is left behind: no child process, no socket directory."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest

from fault_helpers import alive, assert_nothing_left, shm_entries, wait_for
from l3worker import DistributedWorker
from l3worker.serving.runner import ServerThread
from server_helpers import metric, sse_events, started_processes, stream_into, stream_raw, wait_until

RESTARTS = "l3worker:engine_restarts_total"
GREEDY = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
SEEDED = {**GREEDY, "temperature": 0.9, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def server():
    shm_before = shm_entries()
    worker = DistributedWorker(None, device="cpu", max_batch_size=2, max_seq_len=4096, page_size=16, num_threads=1,
                               max_waiting_requests=2, step_timeout_s=30.0)
    srv = ServerThread(worker).start()
    socket_dir, children = worker.socket_dir, []
    yield srv, children
    children += [psutil.Process(pid) for pid in worker.child_pids]
    srv.stop()
    assert_nothing_left(children, socket_dir, shm_before)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


def kill_child(server) -> None:
    srv, children = server
    child = psutil.Process(srv.engine.worker.child_pids[0])
    children.append(child)
    child.kill()


def completion(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_idle_death_is_repaired_with_no_request_running(server, http) -> None:
    before = [completion(http, GREEDY), completion(http, SEEDED)]
    restarts = metric(http, RESTARTS)
    kill_child(server)
    # Nothing is sent meanwhile: the idle engine must notice the death itself.
    wait_until(lambda: metric(http, RESTARTS) == restarts + 1, 60, "a restart")
    wait_until(lambda: http.get("/health").status_code == 200, 60, "/health 200 again")
    assert [completion(http, GREEDY), completion(http, SEEDED)] == before


def test_health_and_requests_agree_through_a_local_restart(server, http) -> None:
    """A local restart queues requests, so /health stays 200 through it: sampled every 20 ms on
    its own connection while requests run, it never says 503 while they are served."""
    restarts = metric(http, RESTARTS)
    health: list[int] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=server[0].url, timeout=30) as c:
            while not done.is_set():
                health.append(c.get("/health").status_code)
                done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        kill_child(server)
        served = [http.post("/v1/completions", json={**GREEDY, "max_tokens": 2}).status_code for _ in range(3)]
        wait_until(lambda: metric(http, RESTARTS) == restarts + 1, 60, "a restart")
    finally:
        done.set()
        watcher.join(30)
    assert served == [200, 200, 200]
    assert health and set(health) == {200}


def test_streams_open_across_a_death_end_as_undisturbed_ones() -> None:
    # Each of the first two generations of children exits at its 21st decode step: mid-stream.
    shm_before = shm_entries()
    worker = DistributedWorker(None, device="cpu", max_batch_size=2, max_seq_len=256, page_size=16, num_threads=1,
                               fault_injection=["exit@20", "exit@20"])
    with ServerThread(worker) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        socket_dir, children = worker.socket_dir, [psutil.Process(pid) for pid in worker.child_pids]
        streamed = []
        for body in (GREEDY, SEEDED):
            r, raw = stream_raw(http, "/v1/completions", {**body, "stream": True})
            events = sse_events(raw)
            assert not any("error" in e for e in events[:-1]), events[-2]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            streamed.append("".join(e["choices"][0]["text"] for e in events[:-1]))
            children += [psutil.Process(pid) for pid in worker.child_pids]
        assert metric(http, RESTARTS) == 2
        assert streamed == [completion(http, GREEDY)["text"], completion(http, SEEDED)["text"]]
    assert_nothing_left(children, socket_dir, shm_before)


def test_a_full_queue_answers_503(server, http) -> None:
    """Two rows run, two requests wait (max_waiting_requests=2): the next one is refused."""
    stop = threading.Event()
    # Long enough that the running two cannot finish (and let the waiting two in) before the poll sees them.
    long = {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}

    def hold() -> None:
        with httpx.Client(base_url=server[0].url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                             json=long) as r:
            for _ in r.iter_raw():
                if stop.is_set():
                    return  # closing the stream aborts the request

    holders = [threading.Thread(target=hold) for _ in range(4)]
    try:
        # Two at a time: four arriving before a step could leave four waiting, and the queue limit
        # would refuse two of them before any took a row.
        for t in holders[:2]:
            t.start()
        wait_until(lambda: metric(http, "l3worker:num_requests_running") == 2, 60, "two running requests")
        for t in holders[2:]:
            t.start()
        wait_until(lambda: metric(http, "l3worker:num_requests_waiting") == 2, 60, "two waiting requests")
        r = http.post("/v1/completions", json=GREEDY)
        assert r.status_code == 503, r.text
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "server_error",
                                      "param": None, "code": "server_overloaded"}}
        assert "max_waiting_requests" in r.json()["error"]["message"]
    finally:
        stop.set()
        for t in holders:
            if t.ident is not None:  # started
                t.join(60)
    wait_until(lambda: metric(http, "l3worker:num_requests_running") == 0, 60, "the held requests aborted")
    completion(http, GREEDY)


# -- `l3worker serve` ------------------------------------------------------------------------------------
def _nothing_left(s, children: list[psutil.Process]) -> None:
    assert wait_for(lambda: not any(alive(c) for c in children)), "chip-children outlived the server"
    assert os.listdir(s.tmpdir) == []  # the socket directory


def test_sigterm_ends_every_open_stream_with_done(served) -> None:
    s = served("--max-num-seqs", "2", "--max-model-len", "4096", "--block-size", "16")
    url, _ = s.ready().groups()
    children = psutil.Process(s.proc.pid).children(recursive=True)
    # Long enough that none can finish before the signal, whatever the machine's speed.
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    streams = [([], threading.Event()) for _ in range(3)]  # two running, one waiting for a row
    readers = [stream_into(url, body, raw, started) for raw, started in streams]
    with httpx.Client(base_url=url, timeout=60) as http:
        wait_until(lambda: metric(http, "l3worker:num_requests_running") == 2
                   and metric(http, "l3worker:num_requests_waiting") == 1, 60, "two running, one waiting")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    for t in readers:
        t.join(30)
    for k, (raw, _) in enumerate(streams):
        events = sse_events(b"".join(raw))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort", (k, events[-2])
    _nothing_left(s, children)


def test_restarts_exhausted_answer_503_and_exit_cleanly(served) -> None:
    s = served("--max-num-seqs", "1", "--max-model-len", "64", "--block-size", "16", "--max-restarts", "1")
    url, _ = s.ready().groups()
    http = httpx.Client(base_url=url, timeout=60)
    children = started_processes(s.proc.pid, "chip_child")
    engine_core = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    children[0].kill()
    wait_until(lambda: metric(http, RESTARTS) == 1, 60, "a restart")
    # /health stays 200 through a restart (requests resume), so wait for the new child itself,
    # then for a completion it serves.
    old_pids = {c.pid for c in children}
    wait_until(lambda: any(c.pid not in old_pids for c in started_processes(s.proc.pid, "chip_child")),
               60, "a new chip_child")
    assert http.post("/v1/completions", json=GREEDY).status_code == 200
    second = [c for c in started_processes(s.proc.pid, "chip_child") if c.pid not in old_pids]
    assert second and http.get("/health").status_code == 200
    children += second + engine_core
    second[0].kill()  # one more than --max-restarts allows
    wait_until(lambda: http.get("/health").status_code == 503, 60, "/health 503")
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert "engine is dead" in r.json()["error"]["message"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert any("restarting the children" in line for line in s.stderr)
    _nothing_left(s, children)
