"""Tensor parallel across two nodes: the head (this process's DistributedWorker, or `l3worker serve`)
and a follower (`l3worker serve --headless`) in a process tree of its own, over the loopback,
cpu ranks over gloo. Same tokens as transformers; a follower that dies fails the head at once;
a follower exits when its head goes away; nothing is left behind."""
from __future__ import annotations

import os
import signal
import subprocess

import httpx
import psutil
import pytest
import torch

from fault_helpers import alive, guard, shm_entries, wait_for
from l3worker import DistributedWorker, SamplingParams
from l3worker.errors import WorkerError
from l3worker.distributed.follower import follower_command
from l3worker.distributed.nodes import NodeLayout, free_master_port
from node_helpers import ROOT, wait_for_log_line
from server_helpers import Served

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 45))]
WORKER = dict(device="cpu", tensor_parallel_size=2, nnodes=2, max_batch_size=4, max_seq_len=128, page_size=8,
              startup_timeout_s=120)


def tree(pid: int) -> list[psutil.Process]:
    """A process and its descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def gone(procs: list[psutil.Process]) -> bool:
    return wait_for(lambda: not any(alive(p) for p in procs))


def test_greedy_across_two_nodes_matches_transformers(make_checkpoint, hf_model, follower) -> None:
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    model = hf_model(path)
    ref = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
           for p in PROMPTS]
    port = free_master_port(2)
    node = follower(path, port)
    with guard(), DistributedWorker(str(path), master_port=port, **WORKER) as w:
        follower_tree = tree(node.pid)
        assert len(follower_tree) == 2  # the follower and its one chip-child (rank 1)
        head_children = [psutil.Process(pid) for pid in w.child_pids[:1]]
        outs = w.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24))
        socket_dir = w.socket_dir
    assert [o.token_ids for o in outs] == ref
    assert node.wait(30) == 0  # the head closed: its follower exits
    assert gone(follower_tree + head_children)
    assert not os.path.exists(socket_dir)


def test_a_killed_follower_fails_the_head_and_leaves_nothing(make_checkpoint, follower) -> None:
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    node = follower(path, port)
    shm_before = shm_entries()
    with guard(), DistributedWorker(str(path), master_port=port, max_restarts=0, **WORKER) as w:
        w.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
        follower_tree = tree(node.pid)
        head_children = [psutil.Process(pid) for pid in w.child_pids[:1]]
        socket_dir = w.socket_dir
        stream = w.stream(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True))
        next(stream)
        os.killpg(node.pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="follower node 1|chip-child 0"):
            for _ in stream:
                pass
        assert not w.healthy
    assert gone(follower_tree + head_children)
    assert not os.path.exists(socket_dir)
    assert wait_for(lambda: not (shm_entries() - shm_before))


def test_a_silent_follower_is_dropped_by_the_heartbeats(make_checkpoint, follower) -> None:
    """A frozen follower (SIGSTOP: no step, no heartbeat, its connection still open, as on a lost
    network) fails the head; woken, it finds the head gone and exits."""
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    node = follower(path, port)
    with guard(), DistributedWorker(str(path), master_port=port, max_restarts=0, **WORKER) as w:
        w.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
        follower_tree = tree(node.pid)
        stream = w.stream(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True))
        next(stream)
        os.killpg(node.pid, signal.SIGSTOP)
        try:
            with pytest.raises(WorkerError, match="follower node 1 .* lost its connection"):
                for _ in stream:
                    pass
        finally:
            os.killpg(node.pid, signal.SIGCONT)
    assert node.wait(30) == 0
    assert gone(follower_tree)


def test_a_follower_that_comes_back_is_restarted_and_requests_resume(make_checkpoint, follower) -> None:
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    first = follower(path, port)
    with guard(), DistributedWorker(str(path), master_port=port, max_restarts=1, **WORKER) as w:
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        expected = [o.token_ids for o in w.generate(PROMPTS, params)]
        stream = w.stream(PROMPTS, params)
        got: dict[str, list[int]] = {}
        out = next(stream)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        # The node is back, as a supervisor would restart it; the head's restart waits for it
        # (REJOIN_WAIT_S), and this test waits until it connects, whatever the machine's load.
        wait_for_log_line(follower(path, port), "waiting for the head")
        for out in stream:
            if out.finished:
                got[out.request_id] = out.token_ids
        assert w.engine.restarts.total == 1
        assert w.healthy
    assert sorted(got.values()) == sorted(expected)


def _served_over_two_nodes(make_checkpoint, follower, max_restarts: int):
    """(checkpoint, follower process, `l3worker serve` head) of a tensor-parallel pair on the loopback."""
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    node = follower(path, port)
    head = Served(str(path), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2",
                  "--master-port", str(port), "--max-model-len", "128", "--block-size", "8", "--max-restarts",
                  str(max_restarts))
    return path, node, head


def test_served_across_nodes_a_killed_follower_answers_503_and_sigterm_stops_everything(
        make_checkpoint, follower) -> None:
    path, node, head = _served_over_two_nodes(make_checkpoint, follower, max_restarts=0)
    try:
        url = head.ready().group(1)
        head_tree = tree(head.proc.pid)
        follower_tree = tree(node.pid)
        assert len(head_tree) == 3  # the API server, its engine core and one chip-child
        assert len(follower_tree) == 2  # the follower and one chip-child
        with httpx.Client(base_url=url, timeout=60) as client:
            body = {"model": str(path), "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            os.killpg(node.pid, signal.SIGKILL)
            assert wait_for(lambda: client.get("/health").status_code == 503, 30)
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503 and "follower node 1" in r.text
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(60) == 0
        assert gone(head_tree + follower_tree)
        assert not list(head.tmpdir.iterdir())  # no socket dir left
    finally:
        head.stop()


def test_served_while_a_restart_waits_for_a_follower_requests_get_503_at_once_as_health_does(
        make_checkpoint, follower) -> None:
    path, node, head = _served_over_two_nodes(make_checkpoint, follower, max_restarts=1)
    try:
        url = head.ready().group(1)
        body = {"model": str(path), "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
        with httpx.Client(base_url=url, timeout=10) as client:  # a request held for the follower would time out
            assert client.post("/v1/completions", json=body).status_code == 200
            os.killpg(node.pid, signal.SIGKILL)
            assert wait_for(lambda: client.get("/health").status_code == 503, 30)
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503 and "wait for another node" in r.text
            assert client.get("/health").status_code == 503
    finally:
        head.stop()


def test_a_follower_exits_when_its_head_is_killed(make_checkpoint, follower) -> None:
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    node = follower(path, port)
    head = Served(str(path), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2",
                  "--master-port", str(port), "--max-model-len", "128", "--block-size", "8")
    try:
        head.ready()
        head_tree = tree(head.proc.pid)
        follower_tree = tree(node.pid)
        os.kill(head.proc.pid, signal.SIGKILL)
        assert node.wait(60) == 0
        assert gone(head_tree + follower_tree)
        assert os.listdir(node.tmpdir) == []  # the follower's socket dir went with it
    finally:
        head.stop()


def test_a_follower_holding_other_weights_is_refused_by_name(make_checkpoint, follower) -> None:
    # Same shapes, other values: without the check the ranks would run and give wrong tokens.
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    other = make_checkpoint("tp-nodes-other-seed", seed=1, num_attention_heads=8, num_key_value_heads=2)
    port = free_master_port(2)
    follower(other, port)
    worker = DistributedWorker(str(path), master_port=port, max_restarts=0, **WORKER)
    with guard(), pytest.raises(WorkerError, match=r"follower node 1: .* is not the head's model: tensor \S+ differs"):
        worker.prepare()
    assert worker.stats()["state"] == "closed"


def test_layout_is_checked_before_anything_starts(make_checkpoint) -> None:
    path = make_checkpoint("tp-nodes", num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match="master_port"):
        DistributedWorker(str(path), device="cpu", tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        DistributedWorker(str(path), device="cpu", tensor_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="device_ids"):
        DistributedWorker(str(path), device="cpu", device_ids=(0, 1), tensor_parallel_size=2, nnodes=2,
                          master_port=29500)
    with pytest.raises(ValueError, match="headless"):
        DistributedWorker(str(path), device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)
    usage = subprocess.run(follower_command(str(path), NodeLayout(2, 2, 0, "127.0.0.1", 29500)), cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "node 0 is the head" in usage.stderr
