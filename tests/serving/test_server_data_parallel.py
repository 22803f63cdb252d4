"""`l3worker serve --data-parallel-size 2`: two engine cores behind the API server(s), each with its
own chip-child and its share of the cores. What must hold: greedy output is offline generate()'s
whichever engine serves it; cache-aware routing keeps prefix-cache hits that round-robin loses when
each engine's KV pool holds about half the prefixes; one killed engine core is 503 at once; SIGTERM
stops every process and leaves no file. The router's own decisions: tests/distributed/test_router.py."""
from __future__ import annotations

import os
import signal

import httpx
import psutil

from fault_helpers import alive, shm_entries, wait_for
from server_helpers import (assert_engines_give_offline_greedy, metric, started_processes,
                            wait_until)

BLOCK = 16
SMALL = ("--max-num-seqs", "2", "--max-model-len", "64", "--block-size", str(BLOCK))


def _gone(procs: list[psutil.Process]) -> bool:
    return not any(alive(p) for p in procs)


def _post(url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120, headers={"connection": "close"}) as c:
        return c.post("/v1/completions", json=body)


def test_two_engines_give_offline_greedy_output_and_stop_together(served) -> None:
    shm_before = shm_entries()
    s = served(*SMALL, "--data-parallel-size", "2", "--api-server-count", "2")
    url, _ = s.ready().groups()
    cores = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    assert len(cores) == 2 and len(started_processes(s.proc.pid, "chip_child")) == 2
    if len(os.sched_getaffinity(0)) >= 2:  # each engine core its own share of the cores
        assert not set(cores[0].cpu_affinity()) & set(cores[1].cpu_affinity())
    everything = psutil.Process(s.proc.pid).children(recursive=True)
    # Both engines served (new prompts spread), and one scrape shows both under an engine label.
    assert_engines_give_offline_greedy(url, 2, max_batch_size=2, max_seq_len=64, page_size=BLOCK)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert wait_for(lambda: _gone(everything)), "a process outlived the server"
    assert os.listdir(s.tmpdir) == [] and wait_for(lambda: not shm_entries() - shm_before)


def _prefix_hits(served, routing: str, order: list[int]) -> tuple[float, float]:
    """Prompt tokens the engines' prefix caches supplied, and looked up, over requests sent one at
    a time; prefix k is two full pages of its own, then a suffix of each request's own."""
    # 6 pages per engine: two prefixes (4 pages) and a request's last page fit, three prefixes do not.
    s = served(*SMALL, "--data-parallel-size", "2", "--data-parallel-routing", routing,
               "--num-gpu-blocks-override", "6")
    url, _ = s.ready().groups()
    for n, k in enumerate(order):
        prompt = [(11 * k + j) % 300 + 1 for j in range(2 * BLOCK)] + [301 + n % 19, 2, 3, 4]
        assert _post(url, {"prompt": prompt, "max_tokens": 2, "temperature": 0}).status_code == 200
    with httpx.Client(base_url=url, timeout=60) as http:
        hits = metric(http, "l3worker:prefix_cache_hits_total")
        queries = metric(http, "l3worker:prefix_cache_queries_total")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    return hits, queries


def test_cache_aware_routing_keeps_prefix_hits_that_round_robin_loses(served) -> None:
    # Each prefix comes back to both engines under round_robin (A B C D, then B A D C, ...), so
    # each engine cycles through all four and its LRU pool of ~2.5 prefixes keeps none.
    order = [0, 1, 2, 3, 1, 0, 3, 2] * 2
    aware, aware_queries = _prefix_hits(served, "cache_aware", order)
    rr, rr_queries = _prefix_hits(served, "round_robin", order)
    assert aware_queries == rr_queries == len(order) * (2 * BLOCK + 4)
    # cache_aware: prefixes 0 and 2 on engine 0, 1 and 3 on engine 1; every request after the
    # first four finds its two pages.
    assert aware == (len(order) - 4) * 2 * BLOCK
    assert aware > rr, (aware, rr)


def test_with_kv_events_the_router_follows_what_the_engines_store(served) -> None:
    """--kv-events-config: each engine publishes on its rank's port, and the API server's router
    applies their batches (its own /metrics series); routing keeps the cache-aware hits."""
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # ranks publish on port and port + 1
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
    s = served(*SMALL, "--data-parallel-size", "2", "--num-gpu-blocks-override", "6", "--kv-events-config", events)
    ready = s.ready()
    assert "2 engines (cache_aware, following their KV events)" in ready.string
    order = [0, 1, 2, 3, 1, 0, 3, 2]
    for n, k in enumerate(order):
        prompt = [(11 * k + j) % 300 + 1 for j in range(2 * BLOCK)] + [301 + n, 2, 3, 4]
        assert _post(ready[1], {"prompt": prompt, "max_tokens": 2, "temperature": 0}).status_code == 200
    with httpx.Client(base_url=ready[1], timeout=60) as http:
        # one BlockStored per prefix (its two pages in one event); the later requests store nothing
        wait_until(lambda: metric(http, "l3worker:router_kv_events_total") >= 4)
        assert metric(http, "l3worker:router_kv_event_batches_lost_total") == 0
        assert metric(http, "l3worker:prefix_cache_hits_total") == (len(order) - 4) * 2 * BLOCK
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]


def test_a_killed_engine_core_is_503_at_once_and_sigterm_leaves_nothing(served) -> None:
    shm_before = shm_entries()
    s = served(*SMALL, "--data-parallel-size", "2")
    url, _ = s.ready().groups()
    everything = psutil.Process(s.proc.pid).children(recursive=True)
    cores = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    http = httpx.Client(base_url=url, timeout=60)
    assert http.get("/health").status_code == 200
    cores[1].kill()
    wait_until(lambda: http.get("/health").status_code == 503, 30, "/health 503 after an engine core died")
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert wait_for(lambda: _gone(everything)), "a process outlived the server"
    assert os.listdir(s.tmpdir) == [] and wait_for(lambda: not shm_entries() - shm_before)


def test_devices_the_engines_cannot_share_are_refused(served) -> None:
    s = served("--data-parallel-size", "3", "--device-ids", "0,1")
    assert s.proc.wait(60) == 2
    assert any("cannot share equally" in line for line in s.stderr)


def test_each_engine_gets_its_consecutive_share_of_devices_and_cores(monkeypatch) -> None:
    from l3worker.serving import launcher
    from l3worker.serving.launcher import DataParallel

    kwargs = {"device_ids": None, "device": "cuda"}
    dp = DataParallel(2)
    assert [dp.engine_kwargs(kwargs, e)["device_ids"] for e in (0, 1)] == [[0], [1]]  # the default: one each
    tp2 = {**kwargs, "tensor_parallel_size": 2}
    assert [dp.engine_kwargs(tp2, e)["device_ids"] for e in (0, 1)] == [[0, 1], [2, 3]]
    four = {**kwargs, "device_ids": [4, 5, 6, 7]}
    assert [dp.engine_kwargs(four, e)["device_ids"] for e in (0, 1)] == [[4, 5], [6, 7]]  # tensor parallel each
    assert DataParallel(1).engine_kwargs(four, 0) is four
    assert dp.cpu_cores(kwargs, 0) is None  # an accelerator: no core pinning
    monkeypatch.setattr(launcher, "allowed_cores", lambda: [0, 1, 2, 3, 4])
    cpu = {**kwargs, "device": "cpu"}
    assert [dp.cpu_cores(cpu, e) for e in (0, 1)] == [[0, 1], [2, 3]]
    assert DataParallel(6).cpu_cores(cpu, 0) is None  # fewer cores than engines: all share them
    router = dp.router(16, 100, 8)
    assert (router.num_engines, router.page_size, router.capacity_pages, router.load_margin) == (2, 16, 100, 4)
    assert DataParallel(1).router(16, 100, 8) is None
