"""Data-parallel engines across nodes: a head (`l3worker serve --data-parallel-size 2
--data-parallel-size-local 1`, engine 0 and the HTTP API) and a headless node (`l3worker serve
--headless ... --data-parallel-start-rank 1`, engine 1) as separate process trees on the loopback.
What must hold: greedy output is offline generate()'s whichever engine serves it and both engines
serve (per-engine metrics in one scrape); a node with the wrong max_model_len is refused by name;
a killed node fails its in-flight requests at once, /health turns 503 and the head routes to the
engine left; SIGTERM to the head makes the node exit by itself; nothing is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from fault_helpers import alive, shm_entries, wait_for
from l3worker.distributed.nodes import free_master_port
from l3worker.serving import cli
from node_helpers import kill_nodes, start_node
from server_helpers import (assert_engines_give_offline_greedy, metric, sse_events, stream_into,
                            wait_until)

BLOCK = 16
SMALL = ("--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "64", "--block-size", str(BLOCK))


def dp_flags(port: int, *, local: int = 1) -> tuple[str, ...]:
    return ("--data-parallel-size", "2", "--data-parallel-size-local", str(local),
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port))


@pytest.fixture
def node(tmp_path: Path):
    """node(port, *flags) -> a headless node (rank 1) in a process tree of its own; killed at the end."""
    started: list[subprocess.Popen] = []

    def start(port: int, *flags: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "l3worker", "serve", "--headless", *dp_flags(port), "--data-parallel-start-rank",
               "1", *flags]
        started.append(start_node(cmd, tmp_path / f"node{len(started)}", "node.log"))
        return started[-1]

    yield start
    kill_nodes(started)


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def gone(procs: list[psutil.Process]) -> bool:
    return wait_for(lambda: not any(alive(p) for p in procs), 30)


def _post(url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120, headers={"connection": "close"}) as c:
        return c.post("/v1/completions", json=body)


def test_head_and_headless_engine_give_offline_greedy_output_and_stop_together(served, node, tmp_path: Path) -> None:
    shm_before = shm_entries()
    port = free_master_port(1)
    s = served(*SMALL, *dp_flags(port), "--api-server-count", "2")  # the node serves each API server
    wrong = node(port, *SMALL[:-4], "--max-model-len", "32", *SMALL[-2:])  # refused by name before it loads
    assert wrong.wait(120) == 1
    assert "--max-model-len differs: the head has 64, data-parallel rank 1 has 32" in \
        (tmp_path / "node0" / "node.log").read_text()
    headless = node(port, *SMALL)
    url, _ = s.ready().groups()
    head_tree, node_tree = tree(s.proc.pid), tree(headless.pid)
    assert len(node_tree) == 3  # the node, its engine core and that core's chip-child
    # Both engines served (new prompts spread), and one scrape shows both under an engine label.
    assert_engines_give_offline_greedy(url, 2, max_batch_size=2, max_seq_len=64, page_size=BLOCK)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert headless.wait(60) == 0  # the head went away: the node stops on its own
    assert gone(head_tree + node_tree), "a process outlived the head or the node"
    assert os.listdir(s.tmpdir) == [] and os.listdir(headless.tmpdir) == []
    assert wait_for(lambda: not shm_entries() - shm_before)


def test_a_killed_headless_node_fails_its_requests_and_health_but_not_the_other_engine(served, node) -> None:
    shm_before = shm_entries()
    port = free_master_port(1)
    s = served(*SMALL[:-4], "--max-model-len", "4096", *SMALL[-2:], *dp_flags(port),
               "--data-parallel-routing", "round_robin")
    headless = node(port, *SMALL[:-4], "--max-model-len", "4096", *SMALL[-2:])
    url, _ = s.ready().groups()
    head_tree, node_tree = tree(s.proc.pid), tree(headless.pid)
    http = httpx.Client(base_url=url, timeout=60)
    assert _post(url, {"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200  # engine 0: the next is 1's
    raw: list[bytes] = []
    started = threading.Event()
    reader = stream_into(url, {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True},
                         raw, started)
    assert started.wait(60)
    os.killpg(headless.pid, signal.SIGKILL)
    reader.join(60)
    assert not reader.is_alive()
    events = sse_events(b"".join(raw))
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert "data-parallel rank 1" in events[-2]["error"]["message"]
    assert len(events) < 4000  # it ended with the node, not at max_tokens
    wait_until(lambda: http.get("/health").status_code == 503, 30, "/health 503 after the node died")
    assert _post(url, {"prompt": [4, 5, 6], "max_tokens": 2}).status_code == 200  # engine 0 still serves
    assert metric(http, "l3worker:generation_tokens_total", 'engine="0"') > 0
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert gone(head_tree + node_tree)
    assert os.listdir(s.tmpdir) == [] and wait_for(lambda: not shm_entries() - shm_before)


def test_a_headless_node_exits_when_its_head_is_killed(served, node) -> None:
    port = free_master_port(1)
    s = served(*SMALL, *dp_flags(port))
    headless = node(port, *SMALL)
    s.ready()
    head_tree, node_tree = tree(s.proc.pid), tree(headless.pid)
    os.kill(s.proc.pid, signal.SIGKILL)  # no stop message: the node sees its link close
    assert headless.wait(60) == 0
    assert gone(head_tree + node_tree)
    assert os.listdir(headless.tmpdir) == []  # the node's socket directory went with it


@pytest.mark.parametrize("argv, named", [
    (["--headless", "-dp", "2", "--data-parallel-start-rank", "1", "--data-parallel-rpc-port", "5"],
     "--data-parallel-address is needed"),
    (["--headless", "-dp", "2", "--data-parallel-start-rank", "2", "--data-parallel-address", "h",
      "--data-parallel-rpc-port", "5"], "--data-parallel-start-rank must be in [0, --data-parallel-size=2)"),
    (["--headless", "-dp", "3", "--data-parallel-start-rank", "1", "--data-parallel-size-local", "3",
      "--data-parallel-address", "h", "--data-parallel-rpc-port", "5"], "exceeds --data-parallel-size 3"),
    (["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "h"],
     "--data-parallel-rpc-port must be a port"),
    (["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "h", "--data-parallel-rpc-port",
      "70000"], "--data-parallel-rpc-port must be a port"),
    (["-dp", "2", "--data-parallel-start-rank", "1"], "--data-parallel-start-rank belongs to --headless"),
    (["--nnodes", "2", "--data-parallel-address", "h"], "--data-parallel-address with --nnodes"),
    (["-dp", "2", "--data-parallel-silence-timeout", "0.5"], "--data-parallel-silence-timeout must be > 1 second"),
])
def test_bad_data_parallel_node_flags_are_refused_by_name(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_ranks_that_never_connect_end_the_relay_at_the_start_up_timeout(tmp_path: Path, caplog) -> None:
    from l3worker.distributed.dp_remote import RemoteConfig, RemoteEngines

    config = RemoteConfig(f"tcp://127.0.0.1:{free_master_port(1)}", {"1": f"ipc://{tmp_path}/core-1"},
                          [f"ipc://{tmp_path}/out-0"], os.getpid(),
                          dict(dp_size=2, model="m", max_model_len=64, vocab_size=10), startup_timeout_s=0.5)
    assert RemoteEngines(config).run() == 1
    assert "data-parallel rank(s) 1 did not connect" in caplog.text and "start-up timeout" in caplog.text


def test_sigterm_while_the_head_waits_for_its_nodes_stops_it(served) -> None:
    s = served(*SMALL, *dp_flags(free_master_port(1)))
    wait_until(lambda: len(tree(s.proc.pid)) >= 3, 120, "the head's engine core and relay")  # now waiting
    head_tree = tree(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    assert gone(head_tree)
    assert os.listdir(s.tmpdir) == []


def test_a_silent_node_is_lost_by_the_heartbeats_and_told_to_stop(tmp_path: Path) -> None:
    """A registered rank that stops pinging (a frozen node: its connection still open) is lost
    after dp_link.SILENCE_S: each API server hears it on that rank's control socket, the node a stop."""
    import msgpack
    import zmq

    from l3worker.serving.core_wire import unpack
    from l3worker.distributed.nodes import link_socket
    from l3worker.distributed.dp_link import REGISTER, STOP, WELCOME, Registration
    from l3worker.distributed.dp_remote import RemoteConfig, RemoteEngines

    config = RemoteConfig(f"tcp://127.0.0.1:{free_master_port(1)}", {"1": f"ipc://{tmp_path}/core-1"},
                          [f"ipc://{tmp_path}/out-0"], os.getpid(),
                          dict(dp_size=2, model="m", max_model_len=64, vocab_size=10))
    relay = RemoteEngines(config)
    thread = threading.Thread(target=relay.run)
    thread.start()
    ctx = zmq.Context()
    try:
        api = ctx.socket(zmq.DEALER)
        api.setsockopt(zmq.IDENTITY, b"api-0")
        api.connect(config.controls["1"])
        link, monitor = link_socket(ctx)
        link.connect(config.endpoint)
        link.send_multipart([REGISTER, Registration(1, 2, "m", 64, 10).to_wire()])
        kind, body = link.recv_multipart()
        assert kind == WELCOME and msgpack.unpackb(body) == {"api_server_count": 1}
        assert api.poll(30_000), "no lost message"
        kind, text = unpack(api.recv())
        assert kind == "lost" and "data-parallel rank 1's node went silent" in text
        kinds: list[bytes] = []  # pings, then the stop
        while STOP not in kinds and link.poll(10_000):
            kinds.append(link.recv_multipart()[0])
        assert STOP in kinds
        monitor.close(0)
    finally:
        relay.stopping = True
        thread.join(30)
        ctx.destroy(linger=0)


def _relay(tmp_path: Path, **expected):
    """A relay for rank 1 in a thread (silence limit 1.5 s), an API server's control socket and a
    node's link to it: (relay, its thread, api, link, monitor, ctx)."""
    import zmq

    from l3worker.distributed.dp_remote import RemoteConfig, RemoteEngines
    from l3worker.distributed.nodes import link_socket

    config = RemoteConfig(f"tcp://127.0.0.1:{free_master_port(1)}", {"1": f"ipc://{tmp_path}/core-1"},
                          [f"ipc://{tmp_path}/out-0"], os.getpid(),
                          dict(dp_size=2, model="m", max_model_len=64, vocab_size=10, **expected), silence_s=1.5)
    relay = RemoteEngines(config)
    thread = threading.Thread(target=relay.run)
    thread.start()
    ctx = zmq.Context()
    api = ctx.socket(zmq.DEALER)
    api.setsockopt(zmq.IDENTITY, b"api-0")
    api.connect(config.controls["1"])
    link, monitor = link_socket(ctx)
    link.connect(config.endpoint)
    return relay, thread, api, link, monitor, ctx, config


def test_a_rank_with_other_weights_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from l3worker.distributed.dp_link import REFUSED, REGISTER, Registration

    relay, thread, api, link, monitor, ctx, _ = _relay(tmp_path, fingerprint={"config.json": "c", "w": "1"})
    try:
        link.send_multipart([REGISTER, Registration(1, 2, "m", 64, 10, {"config.json": "c", "w": "2"}).to_wire()])
        assert link.poll(30_000)
        kind, text = link.recv_multipart()
        assert kind == REFUSED and text.decode() == \
            "data-parallel rank 1's checkpoint is not the head's model: tensor w differs (dtype, shape or values)"
        monitor.close(0)
    finally:
        relay.stopping = True
        thread.join(30)
        ctx.destroy(linger=0)


def test_a_lost_rank_that_registers_again_is_taken_back(tmp_path: Path) -> None:
    """Silent past --data-parallel-silence-timeout, rank 1 is lost; a node that registers as rank 1
    again (a restart) is welcomed, and the API servers hear it is back."""
    import msgpack

    from l3worker.distributed.dp_link import REGISTER, WELCOME, Registration
    from l3worker.distributed.nodes import link_socket
    from l3worker.serving.core_wire import unpack

    relay, thread, api, link, monitor, ctx, config = _relay(tmp_path)
    try:
        link.send_multipart([REGISTER, Registration(1, 2, "m", 64, 10).to_wire()])
        assert link.recv_multipart()[0] == WELCOME
        assert api.poll(30_000), "no lost message"
        kind, text = unpack(api.recv())
        assert kind == "lost" and "went silent (nothing for 1.5 s)" in text
        again, again_monitor = link_socket(ctx)  # the restarted node's new connection
        again.connect(config.endpoint)
        again.send_multipart([REGISTER, Registration(1, 2, "m", 64, 10).to_wire()])
        assert again.poll(30_000)
        kind, body = again.recv_multipart()
        assert kind == WELCOME and msgpack.unpackb(body) == {"api_server_count": 1}
        assert api.poll(30_000) and unpack(api.recv()) == ["back"]
        api.send(msgpack.packb(["hello"]))  # the API server's question reaches the new node
        frames = []
        while again.poll(5_000):
            frames = again.recv_multipart()
            if frames[0] != b"ping":
                break
        assert frames[0] == b"ctl" and msgpack.unpackb(frames[2]) == ["hello"]
        for m in (monitor, again_monitor):
            m.close(0)
    finally:
        relay.stopping = True
        thread.join(30)
        ctx.destroy(linger=0)
