"""`python -m l3worker serve` as a user runs it: flags, the ready line, a --chat-template file, and a
signal while a request streams or while the engine starts: exit 0, the request aborted, no child
process or socket dir left."""
from __future__ import annotations

import json
import os
import re
import signal

import httpx
import psutil
import pytest

from fault_helpers import GUARD_S, alive, wait_for
from hub_cache import REPO, lay_out_hub_cache
from server_helpers import assert_step_core_kept, sigterm_mid_stream, started_processes

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def test_sigterm_mid_stream_exits_0_and_leaves_nothing(served, tmp_path) -> None:
    template = tmp_path / "mine.jinja"
    template.write_text(TEMPLATE)
    s = served("--max-num-seqs", "2", "--max-model-len", "2048", "--block-size", "16", "--served-model-name",
               "my-model", "--chat-template", str(template), "--api-key", "k")
    url, name = s.ready().groups()
    assert name == "my-model"
    children = psutil.Process(s.proc.pid).children(recursive=True)
    assert children and os.listdir(s.tmpdir)  # the chip-child and the worker's socket dir
    client = httpx.Client(base_url=url, headers={"authorization": "Bearer k"}, timeout=60)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["my-model"]

    # The --chat-template file renders the prompt.
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == len("[system]S\n[user]hi\n>")

    body = {"prompt": "Hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sigterm_mid_stream(s, client, body)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert os.listdir(s.tmpdir) == []
    assert "l3worker serve: stopped" in [s.lines.get(timeout=5) for _ in range(s.lines.qsize())]
    request_lines = [line for line in s.stderr if "l3worker.serving.requests" in line]
    assert any('"POST /v1/chat/completions" 200' in line and "prompt_tokens=" in line for line in request_lines)


def test_sigint_exits_0(served) -> None:
    s = served("--max-num-seqs", "1", "--max-model-len", "64", "--block-size", "16")
    url, name = s.ready().groups()
    assert name == "l3worker-tiny" and httpx.get(url + "/health").status_code == 200
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert os.listdir(s.tmpdir) == []


def _engine_core_of(proc: psutil.Process) -> psutil.Process | None:
    for child in proc.children():
        try:
            if "l3worker.serving.engine_core" in child.cmdline():
                return child
        except psutil.Error:  # gone, or not yet readable
            continue
    return None


def test_sigterm_while_the_engine_core_starts_ends_its_start_up(served) -> None:
    """A stop before anything serves ends the engine core's start-up instead of waiting for it to
    finish (a model load can take minutes): the server says it stopped while starting, never that
    it is ready, exits 0 and leaves no process or socket dir."""
    s = served("--max-num-seqs", "1", "--max-model-len", "64", "--block-size", "16")
    server = psutil.Process(s.proc.pid)
    core = None

    def core_started() -> bool:  # seconds before it is ready (torch, then its chip-child)
        nonlocal core
        core = _engine_core_of(server)
        return core is not None or s.proc.poll() is not None

    assert wait_for(core_started, GUARD_S) and core is not None, s.stderr[-20:]
    early_children = core.children()  # the chip-child it started before its imports, with no argv to name it by
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    out = [s.lines.get(timeout=5) for _ in range(s.lines.qsize())]
    assert "l3worker serve: stopped while starting" in out, out
    assert not [line for line in out if line.startswith("l3worker serve: ready")]
    assert not alive(core) and not [c for c in early_children if alive(c)]
    # a chip-child names its socket dir, in the server's TMPDIR, in its argv
    assert not [p for p in psutil.process_iter(["cmdline"]) if any(str(s.tmpdir) in a for a in p.info["cmdline"] or ())
                and alive(p)]
    assert os.listdir(s.tmpdir) == []


def test_the_engine_core_and_its_chip_child_start_before_the_arguments_are_checked(served) -> None:
    """Their imports overlap API server 0's (launch time): the core starts first with --early-child,
    and the chip-child it started then serves, handed its spec (--spec-on-stdin)."""
    s = served("--max-num-seqs", "1", "--max-model-len", "64", "--block-size", "16", "--device", "cpu")
    s.ready()
    [core] = started_processes(s.proc.pid, "l3worker.serving.engine_core")
    [child] = started_processes(s.proc.pid, "chip_child")
    assert core.cmdline()[-2:] == ["--early-child", "cpu"] and child.cmdline()[-1] == "--spec-on-stdin"
    assert child.ppid() == core.pid


def test_refused_arguments_end_the_early_engine_core_and_leave_nothing(served, tmp_path) -> None:
    mark = f"refused-{os.getpid()}-{tmp_path.name}"
    s = served("--max-num-seqs", "0", env={"L3WORKER_TEST_MARK": mark})
    assert s.proc.wait(60) == 2
    assert not [p for p in psutil.process_iter() if alive(p) and _has_mark(p, mark)]
    assert os.listdir(s.tmpdir) == []


def _has_mark(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get("L3WORKER_TEST_MARK") == mark
    except psutil.Error:  # gone, or not ours to read
        return False


def test_bad_arguments_exit_2(served, tmp_path) -> None:
    s = served(str(tmp_path / "no-such-model"))
    assert s.proc.wait(60) == 2
    s = served("--max-num-seqs", "0")
    assert s.proc.wait(60) == 2
    assert any("max_batch_size must be >= 1" in line for line in s.stderr)
    s = served("--max-num-seqs", "8", "--max-num-batched-tokens", "4")
    assert s.proc.wait(60) == 2
    assert any("max_num_batched_tokens=4 must be >= max_batch_size=8" in line for line in s.stderr)


def test_scheduling_flags_chunk_long_prompts_and_turn_the_prefix_cache_off(served) -> None:
    s = served("--max-num-batched-tokens", "8", "--no-enable-prefix-caching", "--max-num-seqs", "4",
               "--scheduling-policy", "priority")
    base = s.ready()[1]
    body = {"prompt": "a prompt of many more than eight tokens", "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as client:
        first, second = (client.post("/v1/completions", json={**body, "priority": p}).json() for p in (0, -3))
        metrics = client.get("/metrics").text
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert re.search(r"^l3worker:prefix_cache_queries_total\{engine=\"0\"\} 0\.0$", metrics, re.M)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0


def test_the_cpu_layout_and_kv_events_flags_reach_the_worker(served) -> None:
    import socket

    import msgpack
    import zmq

    with socket.socket() as probe:  # a free port for the events
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
    s = served("--device", "cpu", "--cpu-layout", "every_core", "--max-num-seqs", "2", "--max-model-len", "64",
               "--block-size", "16", "--kv-events-config", events)
    base = s.ready()
    assert ", cpu layout every_core" in base.string
    servers = [psutil.Process(s.proc.pid), *started_processes(s.proc.pid, "l3worker.serving.engine_core")]
    assert_step_core_kept(base.string, servers, started_processes(s.proc.pid, "chip_child")[0])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    prompt = list(range(5, 45))
    with httpx.Client(base_url=base[1], timeout=60) as client:
        for i in range(100):  # until the subscription has reached the publisher: a batch arrives
            assert client.post("/v1/completions", json={"prompt": [200 + i] * 16, "max_tokens": 1}).status_code == 200
            if sub.poll(100):
                break
        while sub.poll(300):
            sub.recv_multipart()
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        metrics = client.get("/metrics").text
    assert sub.poll(10_000)
    _, seq, payload = sub.recv_multipart()
    ts, batch = msgpack.unpackb(payload)
    assert batch[0][0] == "BlockStored"
    assert batch[0][2] is None and batch[0][3] == prompt[:32] and batch[0][4] == 16 and len(batch[0][1]) == 2
    ctx.destroy(linger=0)
    assert re.search(r'^l3worker:cpu_layout_info\{engine="0",layout="every_core"\} 1\.0$', metrics, re.M)
    assert 'layout="spare_core"' not in metrics
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    s = served("--cpu-layout", "all_cores")
    assert s.proc.wait(60) == 2


def test_a_hub_id_is_served_under_that_id_from_the_offline_cache(served, tmp_path) -> None:
    hf_home = tmp_path / "hf"
    lay_out_hub_cache(hf_home / "hub")
    s = served(REPO, "--max-model-len", "256", "--block-size", "16", env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    url, name = s.ready().groups()
    assert name == REPO
    client = httpx.Client(base_url=url, timeout=60)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [REPO]
    done = client.post("/v1/completions", json={"model": REPO, "prompt": "Hi", "max_tokens": 3}).json()
    assert done["model"] == REPO and done["usage"]["completion_tokens"] == 3


def test_agent_and_fidelity_flags_reach_the_server(served) -> None:
    s = served("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--return-tokens-as-token-ids", "--enable-tokenizer-info-endpoint", "--max-num-seqs", "2")
    base = s.ready()[1]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with httpx.Client(base_url=base, timeout=60) as client:
        info = client.get("/tokenizer_info")
        lp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 0}).json()
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools, "max_tokens": 2}).json()
    assert info.status_code == 200 and info.json()["eos_token"] == "<|endoftext|>"
    assert lp["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    assert "reasoning_content" in chat["choices"][0]["message"]  # parsed: the field is there even when empty
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0


def test_auto_tool_choice_without_a_parser_is_a_usage_error(capsys) -> None:
    from l3worker.serving.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--enable-auto-tool-choice"])
    assert e.value.code == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_quantization_and_expert_parallel_flags_reach_the_worker(served) -> None:
    s = served("--quantization", "awq")
    assert s.proc.wait(60) == 2
    assert any("unsupported quantization 'awq'; supported: fp8" in line for line in s.stderr)
    s = served("--enable-expert-parallel", "--device", "cpu", "--device-ids", "0,1")
    assert s.proc.wait(60) == 2
    assert any("enable_expert_parallel: Qwen3ForCausalLM has no experts" in line for line in s.stderr)
    s = served("--quantization", "fp8", "--max-num-seqs", "1", "--max-model-len", "64", "--block-size", "16")
    url = s.ready().group(1)
    done = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 3}, timeout=60).json()
    assert done["usage"]["completion_tokens"] == 3
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
