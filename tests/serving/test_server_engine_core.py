"""`l3worker serve` as processes: the API server, the engine-core process under it (which owns the
chip-children), and with --api-server-count more API servers on the same socket. What must hold:
a killed chip-child is restarted under the engine core and streams go on; the engine core's death is
503 at once, never a hang; SIGTERM stops every process and leaves no file; the engine core exits
when its API server is killed. Plus the wire between them, field by field."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil

from fault_helpers import alive, shm_entries, wait_for
from l3worker.serving.core_wire import output_from_wire, output_to_wire, params_from_wire, params_to_wire, unpack, pack
from l3worker.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprob
from server_helpers import metric, sse_events, started_processes, stream_into

GREEDY = {"prompt": [5, 6, 7], "max_tokens": 600, "temperature": 0, "ignore_eos": True}
SMALL = ("--max-num-seqs", "2", "--max-model-len", "1024", "--block-size", "16")


def _gone(procs: list[psutil.Process]) -> bool:
    return not any(alive(p) for p in procs)


def test_the_engine_core_owns_the_chip_children_and_a_killed_one_is_restarted_mid_stream(served) -> None:
    s = served(*SMALL)
    url, _ = s.ready().groups()
    (core,) = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    (child,) = started_processes(s.proc.pid, "chip_child")
    assert core.ppid() == s.proc.pid and child.ppid() == core.pid  # HTTP and the step loop: two processes
    http = httpx.Client(base_url=url, timeout=120)
    # The longest completion --max-model-len allows: the child must die before the stream ends,
    # and a loaded machine may stall this thread between the first bytes and the kill.
    long = {**GREEDY, "max_tokens": 1000}
    reference = http.post("/v1/completions", json=long).json()["choices"][0]["text"]

    raw: list[bytes] = []
    started = threading.Event()
    reader = stream_into(url, {**long, "stream": True}, raw, started)
    assert started.wait(60)
    child.kill()
    reader.join(120)
    events = sse_events(b"".join(raw))
    chunks = [e for e in events[:-1] if "choices" in e]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference  # resumed where it stopped
    assert metric(http, "l3worker:engine_restarts_total") == 1
    assert started_processes(s.proc.pid, "l3worker.serving.engine_core") == [core]  # the same engine core
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]


def test_a_dead_engine_core_is_503_at_once_and_sigterm_leaves_nothing(served) -> None:
    shm_before = shm_entries()
    s = served(*SMALL)
    url, _ = s.ready().groups()
    everything = psutil.Process(s.proc.pid).children(recursive=True)
    (core,) = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    http = httpx.Client(base_url=url, timeout=60)
    raw: list[bytes] = []
    started = threading.Event()
    reader = stream_into(url, {**GREEDY, "max_tokens": 1000, "stream": True}, raw, started)
    assert started.wait(60)
    core.kill()
    reader.join(60)
    assert not reader.is_alive(), "the open stream hung on a dead engine core"
    events = sse_events(b"".join(raw))
    assert events[-2]["error"]["code"] == "engine_unavailable"  # the 503 of a stream already under way
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert wait_for(lambda: _gone(everything)), "a process outlived the server"
    assert os.listdir(s.tmpdir) == [] and not shm_entries() - shm_before


def test_the_engine_core_and_the_other_api_servers_exit_when_api_server_0_is_killed(served) -> None:
    s = served(*SMALL, "--api-server-count", "2")
    s.ready()
    everything = psutil.Process(s.proc.pid).children(recursive=True)
    for module in ("l3worker.serving.engine_core", "chip_child", "l3worker.serving.api_server"):
        assert started_processes(s.proc.pid, module), module
    s.proc.kill()
    s.proc.wait(30)
    assert wait_for(lambda: _gone(everything)), "a process outlived the API server that started it"
    assert wait_for(lambda: os.listdir(s.tmpdir) == []), os.listdir(s.tmpdir)


def test_two_api_servers_share_the_port_and_the_engine_and_stop_together(served) -> None:
    shm_before = shm_entries()
    s = served(*SMALL, "--api-server-count", "2")
    url, _ = s.ready().groups()
    (other,) = started_processes(s.proc.pid, "l3worker.serving.api_server")
    everything = psutil.Process(s.proc.pid).children(recursive=True)
    body = {**GREEDY, "max_tokens": 8}
    results: list[int] = []

    def one() -> None:  # a connection of its own: either API server may accept it
        with httpx.Client(base_url=url, timeout=120, headers={"connection": "close"}) as c:
            results.append(c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [8] * 8
    # The figures live in the engine core: every scrape, whichever server answers it, counts all.
    for _ in range(10):
        with httpx.Client(base_url=url, timeout=60, headers={"connection": "close"}) as c:
            assert metric(c, "l3worker:request_success_total", 'finished_reason="length"') == 8
            assert c.get("/health").status_code == 200
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert not alive(other)
    assert wait_for(lambda: _gone(everything)), "a process outlived the server"
    assert os.listdir(s.tmpdir) == [] and not shm_entries() - shm_before


def test_the_wire_carries_params_and_outputs_field_for_field() -> None:
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("x", "y"),
                            stop_token_ids=(2,), logprobs=2, n=2, structured_outputs={"choice": ["a", "b"]})
    assert params_from_wire(unpack(pack(params_to_wire(params)))) == params
    lp = TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.25)))
    delta = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(index=1, delta_token_ids=[4], delta_text="d",
                                                                  delta_logprobs=[lp])], prompt_logprobs=[None, lp])
    assert output_from_wire(unpack(pack(output_to_wire(delta))), [1, 2, 3]) == delta
    final = RequestOutput("r", "abc", [1, 2, 3], [CompletionOutput(
        index=0, token_ids=[4, 5], text="de", logprobs=[lp, lp], finish_reason="stop", stop_reason="e",
        delta_token_ids=[5], delta_text="e", delta_logprobs=[lp])], finished=True, num_cached_tokens=2,
        metrics=RequestMetrics(0.1, 0.2, 0.2, 0.0), error="failed alone")
    assert output_from_wire(unpack(pack(output_to_wire(final))), [1, 2, 3]) == final


def test_a_lagging_stream_gets_the_steps_it_missed_as_one_output() -> None:
    import asyncio

    from l3worker.serving.core_client import _Outputs

    lp = [TokenLogprob(t, -1.0) for t in range(4)]

    def step(tokens: list[int], text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(
            index=0, delta_token_ids=tokens, delta_text=text, delta_logprobs=[lp[t] for t in tokens],
            finish_reason="length" if finished else None)], finished=finished)

    async def run() -> list:
        outputs = _Outputs()
        outputs.put(step([0], "a"))
        first = await outputs.get()  # a stream that keeps up sees every step
        for k, tokens in enumerate(([1], [2], [3])):
            outputs.put(step(tokens, "bcd"[k], finished=k == 2))
        outputs.put(RuntimeError("after the end"))
        return [first, await outputs.get(), await outputs.get()]

    first, merged, error = asyncio.run(run())
    assert first.outputs[0].delta_token_ids == [0]
    s = merged.outputs[0]
    assert (s.delta_token_ids, s.delta_text, s.delta_logprobs) == ([1, 2, 3], "bcd", lp[1:])
    assert merged.finished and s.finish_reason == "length" and isinstance(error, RuntimeError)


def test_a_core_that_stops_serving_says_why_even_before_its_death_notice(tmp_path) -> None:
    """Health travels on the control socket and the death notice on the outputs socket, so a 503
    may be written between the two: it must already name the cause, not guess one."""
    import asyncio

    import zmq
    import zmq.asyncio

    from l3worker.serving.core_client import CoreClient
    from l3worker.serving.openai.engine_client import EngineClient
    from l3worker.serving.openai.errors import APIError

    why = "the engine stopped: follower node 1 (ranks from 1) lost its connection"

    async def run() -> tuple[str | None, str | None, str]:
        ctx = zmq.asyncio.Context()
        core = ctx.socket(zmq.ROUTER)
        core.bind(f"ipc://{tmp_path}/control")
        client = CoreClient(0, [f"ipc://{tmp_path}/control"], f"ipc://{tmp_path}/outputs", [os.getpid()])
        try:
            starting = asyncio.ensure_future(client.start())
            who, hello = await core.recv_multipart()
            assert unpack(hello) == ["hello"]
            await core.send_multipart([who, pack(["ready", True, None, None])])
            await starting
            before = client.unavailable_reason
            await core.send_multipart([who, pack(["health", False, why])])
            for _ in range(500):
                if not client.accepting:
                    break
                await asyncio.sleep(0.01)
            with_reason = client.unavailable_reason
            try:
                await EngineClient(client).generate([1, 2], SamplingParams(), "r").__anext__()
                refusal = "served"
            except APIError as e:
                refusal = f"{e.status} {e.message}"
            return before, with_reason, refusal
        finally:
            await client.shutdown()
            ctx.destroy(linger=0)

    before, with_reason, refusal = asyncio.run(run())
    assert before is None
    assert with_reason == why
    assert refusal.startswith("503 ") and "follower node 1" in refusal
