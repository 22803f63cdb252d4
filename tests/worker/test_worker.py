"""DistributedWorker through its public API, with real chip-child processes.

Greedy tokens are compared with transformers' `generate` on the same saved checkpoint; rows use
small pages so they cross page boundaries, and more prompts than rows exercise the queue.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import psutil
import pytest
import torch

from fault_helpers import shm_entries
from parity import hf_greedy
from l3worker import ChildDiedError, ChildError, DistributedWorker, SamplingParams, WorkerError

MAX_NEW = 32
COMMON = dict(max_batch_size=3, max_seq_len=64, page_size=8, device="cpu", num_threads=1, step_timeout_s=60.0)
_rng = np.random.default_rng(1234)
PROMPTS = [_rng.integers(0, 300, n).tolist() for n in (5, 13, 2, 20)]  # 4 prompts on 3 rows: one queues
QUEUE_PROMPTS = [_rng.integers(0, 300, n).tolist() for n in (3, 9, 17, 1, 6, 25, 11)]
QUEUE_NEW = [32, 5, 20, 1, 32, 8, 16]
QUEUE_PAGES = 7  # a 5-page request and a 1-2 page one at most: admission waits for pages as well as rows
SMALL = ([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=2))


def greedy(n: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **{"temperature": 0.0, **kw})


def token_ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


@pytest.fixture(scope="module")
def ref(ckpt: Path, hf_model) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation (MAX_NEW tokens) of every prompt the tests use."""
    model = hf_model(ckpt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with the chip-children
    try:
        return {tuple(p): hf_greedy(model, p, MAX_NEW, ignore_eos=False) for p in [*PROMPTS, *QUEUE_PROMPTS, SMALL[0]]}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workers(ckpt: Path) -> Iterator[Callable[..., DistributedWorker]]:
    """workers(**overrides) -> a prepared worker on `ckpt`, shared per configuration in this module."""
    made: dict[tuple, DistributedWorker] = {}

    def get(model_dir: Path = ckpt, **overrides) -> DistributedWorker:
        key = (str(model_dir), *sorted(overrides.items()))
        if key not in made:
            made[key] = DistributedWorker(model_dir, **{**COMMON, **overrides}).prepare()
        return made[key]

    yield get
    with ThreadPoolExecutor() as pool:  # each close waits for its child to exit: overlap them
        list(pool.map(DistributedWorker.close, made.values()))


@pytest.fixture(scope="module")
def worker(workers) -> DistributedWorker:
    return workers()


def stop_id(ref: dict) -> int:
    """A token greedy really produces for PROMPTS[0], and not as its first one."""
    seq = ref[tuple(PROMPTS[0])]
    return next(t for k, t in enumerate(seq) if k >= 3 and t not in seq[:k])


def truncated_at(seq: list[int], stop: int) -> tuple[list[int], str]:
    return (seq[:seq.index(stop) + 1], "stop") if stop in seq else (seq, "length")


# -- correctness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pipeline_depth,copy_policy", [(1, "dirty"), (2, "dirty"), (3, "dirty"), (2, "always")])
def test_greedy_matches_transformers(workers, ref, pipeline_depth: int, copy_policy: str) -> None:
    w = workers(pipeline_depth=pipeline_depth, copy_policy=copy_policy)
    outs = w.generate(PROMPTS, greedy())
    assert token_ids(outs) == [ref[tuple(p)] for p in PROMPTS]
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert w.stats()["kv_pages_free"] == w.stats()["kv_pages_total"]


def test_more_prompts_than_rows_and_pages(workers, ref) -> None:
    w = workers(num_pages=QUEUE_PAGES)
    params = [greedy(n) for n in QUEUE_NEW]
    outs = w.generate(QUEUE_PROMPTS, params)
    assert [o.token_ids for o in outs] == [ref[tuple(p)][:n] for p, n in zip(QUEUE_PROMPTS, QUEUE_NEW)]
    assert [o.prompt_token_ids for o in outs] == QUEUE_PROMPTS
    assert all(o.finish_reason == "length" for o in outs)
    assert len({o.request_id for o in outs}) == len(QUEUE_PROMPTS)
    st = w.stats()
    assert st["kv_pages_total"] == QUEUE_PAGES
    assert st["kv_pages_free"] == QUEUE_PAGES
    assert st["last_generate"]["requests"] == len(QUEUE_PROMPTS)
    assert st["last_generate"]["generated_tokens"] == sum(QUEUE_NEW)


def test_stop_token_ids(worker, ref) -> None:
    stop = stop_id(ref)
    outs = worker.generate(PROMPTS, greedy(stop_token_ids=(stop,)))
    for out, p in zip(outs, PROMPTS):
        assert (out.token_ids, out.finish_reason) == truncated_at(ref[tuple(p)], stop)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop
    assert worker.stats()["kv_pages_free"] == worker.stats()["kv_pages_total"]


def test_eos_stops_unless_ignored(workers, make_checkpoint, ref) -> None:
    stop = stop_id(ref)
    # Same seed and shapes as the default checkpoint: same weights, with `stop` declared as eos.
    w = workers(make_checkpoint("eos", eos_token_id=stop))
    outs = w.generate(PROMPTS, greedy())
    for out, p in zip(outs, PROMPTS):
        assert (out.token_ids, out.finish_reason) == truncated_at(ref[tuple(p)], stop)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop
    outs = w.generate(PROMPTS, greedy(ignore_eos=True))
    assert token_ids(outs) == [ref[tuple(p)] for p in PROMPTS]
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)


def test_tensor_and_numpy_prompts_equal_list_prompts(worker, ref) -> None:
    p = PROMPTS[1]
    expected = ref[tuple(p)][:8]
    for prompt in (p, np.array(p, np.int32), np.array(p, np.int64), torch.tensor(p)):
        outs = worker.generate(prompt, greedy(8))  # a single prompt in any form is one request
        assert len(outs) == 1 and outs[0].token_ids == expected, type(prompt)
    outs = worker.generate([torch.tensor(PROMPTS[0]), np.array(p), p], greedy(8))
    assert token_ids(outs) == [ref[tuple(PROMPTS[0])][:8], expected, expected]


def test_decode_commands_are_small_and_allocation_free(worker) -> None:
    worker.generate(PROMPTS, greedy())
    last = worker.stats()["last_generate"]
    assert last["decode_steps"] > 0
    assert 0 < last["max_command_bytes"] <= 64
    assert last["decode_step"]["pool_allocs"] == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    assert last["pool_allocs_total"] == 0


def test_reuse_without_refork(worker, ref) -> None:
    pids = worker.child_pids
    assert len(pids) == 1
    started = psutil.Process(pids[0]).create_time()
    calls = worker.stats()["generate_calls"]
    for call in range(3):
        outs = worker.generate(PROMPTS[:2], greedy(4))
        assert token_ids(outs) == [ref[tuple(p)][:4] for p in PROMPTS[:2]]
        assert worker.child_pids == pids
        assert psutil.Process(pids[0]).create_time() == started
        st = worker.stats()
        assert st["generate_calls"] == calls + call + 1
        assert st["last_generate"]["setup_s"] < st["prepare_s"]  # no start-up work again


# -- rejected input --------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("empty prompt", [[]], greedy(), ValueError, r"prompts\[0\].*empty"),
    ("empty array", np.array([], np.int64), greedy(), ValueError, r"prompts\[0\].*empty"),
    ("negative id", [[1, -1, 2]], greedy(), ValueError, r"token id -1.*vocab_size"),
    ("id >= vocab", [[1, 300]], greedy(), ValueError, r"token id 300.*vocab_size"),
    ("too long", [list(range(40))], greedy(30), ValueError, r"max_tokens.*max_seq_len"),
    ("max_tokens 0", [[1, 2]], greedy(0), ValueError, r"max_tokens"),
    ("temperature < 0", [[1, 2]], greedy(temperature=-0.5), ValueError, r"temperature"),
    ("top_p 0", [[1, 2]], greedy(top_p=0.0), ValueError, r"top_p"),
    ("top_p 1.5", [[1, 2]], greedy(top_p=1.5), ValueError, r"top_p"),
    ("top_k < -1", [[1, 2]], greedy(top_k=-2), ValueError, r"top_k"),  # -1 is vLLM's "disabled"
    ("float array", np.array([1.0, 2.0]), greedy(), TypeError, r"prompts\[0\].*dtype"),
    ("float id in a list", [[1, 2.0, 3]], greedy(), TypeError, r"prompts\[0\].*token ids must be ints"),
    ("bool id in a list", [[1, True, 3]], greedy(), TypeError, r"prompts\[0\].*token ids must be ints"),
    ("2-D array", np.ones((2, 3), np.int64), greedy(), ValueError, r"prompts\[0\].*1-D"),
    ("text, no tokenizer", "hello", greedy(), ValueError, r"prompts\[0\].*tokenizer"),
    ("more pages than num_pages", [list(range(30))], greedy(30), ValueError, r"num_pages"),
]


@pytest.mark.parametrize("prompts,params,exc,match", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_rejected_and_worker_still_usable(workers, ref, prompts, params, exc, match) -> None:
    w = workers(num_pages=QUEUE_PAGES)  # 30 + 30 tokens need 8 pages: more than it has, within max_seq_len
    pids = w.child_pids
    with pytest.raises(exc, match=match):
        w.generate(prompts, params)
    outs = w.generate(*SMALL)
    assert outs[0].token_ids == ref[tuple(SMALL[0])][:2]
    assert w.child_pids == pids and w.stats()["state"] == "ready"
    assert w.stats()["kv_pages_free"] == QUEUE_PAGES


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="tpu"), r"device"),
    (dict(page_size=0), r"page_size"),
    (dict(copy_policy="sometimes"), r"copy_policy"),
], ids=["unknown device", "page_size 0", "unknown copy_policy"])
def test_bad_construction_rejected(ckpt: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedWorker(ckpt, **{**COMMON, **kwargs})


def test_child_spec_reads_back_on_the_child_side_as_built(ckpt: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    from chip_child.step.runtime import RuntimeConfig
    from chip_child.child_spec import ChildSpec
    from l3worker.worker.child_process import child_spec
    from l3worker.worker.shared_buffers import StepBuffers

    cfg = replace(RuntimeConfig(str(ckpt), device="cpu", max_batch_size=2, max_seq_len=32, page_size=4),
                  tp_rank=1, tp_size=2)
    ring = StepBuffers.create(slots=3, max_batch_size=2, prefill_capacity=cfg.prefill_capacity)
    spec = child_spec(1, cfg, ring, str(tmp_path), wake_every_step=True, cpu_cores=[0, 1], fault="exit@3")
    back = ChildSpec.from_json(spec.to_json())
    assert back == spec
    assert RuntimeConfig(**back.runtime) == cfg
    assert back.parent_pid == os.getpid() and back.endpoint == f"ipc://{tmp_path}/chip1.sock"
    assert sorted(back.fds) == sorted(ring.fds)
    assert back.buffers["sampled"] == [ring.specs["sampled"].fd, ring.specs["sampled"].nbytes, [3, 2], "int32"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
def test_missing_device_is_reported_by_the_child(ckpt: Path) -> None:
    # The child's start-up error reply must reach the parent before the child exits; tried a few
    # times because losing it is a race.
    for _ in range(3):
        w = DistributedWorker(ckpt, **{**COMMON, "device": "cuda"}, startup_timeout_s=60.0)
        with pytest.raises(ChildError, match=r"device_ids: cuda device 0 does not exist"):
            w.prepare()
        assert w.stats()["state"] == "closed"


# -- failures and clean-up -------------------------------------------------------------------------
def assert_nothing_left(pids: list[int], socket_dir: str, shm_before: set[str]) -> None:
    assert pids and not any(psutil.pid_exists(p) for p in pids)
    assert not os.path.exists(socket_dir)
    assert shm_entries() - shm_before == set()


def test_killed_child_raises_and_close_cleans_up(ckpt: Path) -> None:
    shm_before = shm_entries()
    w = DistributedWorker(ckpt, **{**COMMON, "max_seq_len": 512, "page_size": 16}, max_restarts=0).prepare()
    pids, socket_dir = w.child_pids, w.socket_dir
    assert socket_dir is not None and os.path.isdir(socket_dir)
    try:
        with pytest.raises(ChildDiedError):  # a hang would surface as StepTimeoutError instead
            # Killed once tokens flow, whatever the machine's speed: 480 of them cannot all be out.
            for i, _ in enumerate(w.stream(PROMPTS[0], greedy(480, ignore_eos=True))):
                if i == 2:
                    os.kill(pids[0], signal.SIGKILL)
    finally:
        w.close()
    w.close()  # idempotent
    assert w.stats()["state"] == "closed"
    assert_nothing_left(pids, socket_dir, shm_before)
    with pytest.raises(WorkerError):
        w.generate(*SMALL)


def test_close_lets_the_child_exit_by_itself(ckpt: Path) -> None:
    """close() sends Shutdown and the child exits with code 0 (released everything, ran its exit
    handlers, skipped the interpreter's teardown); a kill after the grace period would show -9."""
    w = DistributedWorker(ckpt, **COMMON).prepare()
    child = w._children[0]
    w.generate(*SMALL)
    w.close()
    assert child.proc.returncode == 0


def test_child_exit_mid_generation(ckpt: Path) -> None:
    shm_before = shm_entries()
    w = DistributedWorker(ckpt, **COMMON, fault_injection="exit@3", max_restarts=0)
    with w:
        pids, socket_dir = w.child_pids, w.socket_dir
        with pytest.raises(ChildDiedError, match="code 3"):
            w.generate(PROMPTS, greedy())
        assert w.stats()["state"] == "closed"  # generate closed it on the way out
    assert_nothing_left(pids, socket_dir, shm_before)


def test_builtin_model_context_manager_and_text() -> None:
    shm_before = shm_entries()
    with DistributedWorker(None, max_batch_size=2, max_seq_len=64, page_size=8, device="cpu",
                           num_threads=1) as w:
        pids, socket_dir = w.child_pids, w.socket_dir
        assert w.stats()["state"] == "ready" and all(psutil.pid_exists(p) for p in pids)
        prompts = ["Hello, world", "Paged attention"]
        outs = w.generate(prompts, greedy(6, ignore_eos=True))
        for out, prompt in zip(outs, prompts):
            assert out.prompt == prompt
            assert out.prompt_token_ids == list(prompt.encode())  # the tiny tokenizer is byte-level
            assert len(out.token_ids) == 6
            assert isinstance(out.text, str)
            assert out.text == w.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        as_ids = w.generate([list(p.encode()) for p in prompts], greedy(6, ignore_eos=True))
        assert token_ids(as_ids) == token_ids(outs)
    assert w.stats()["state"] == "closed"
    assert_nothing_left(pids, socket_dir, shm_before)
    w.close()
    with pytest.raises(WorkerError):
        w.generate(prompts)


def test_step_budget_defaults_to_the_offline_size_and_at_least_the_rows(ckpt: Path, monkeypatch) -> None:
    from l3worker.worker import distributed_worker as worker_module
    from l3worker.params import DEFAULT_BATCHED_TOKENS

    monkeypatch.setattr(worker_module, "ChildProcess", None)  # nothing starts before prepare()
    assert DistributedWorker(ckpt, **COMMON).runtime_config.max_prefill_tokens == DEFAULT_BATCHED_TOKENS
    rows = DEFAULT_BATCHED_TOKENS + 8
    wide = DistributedWorker(ckpt, **{**COMMON, "max_batch_size": rows, "max_seq_len": 16})
    assert wide.runtime_config.max_prefill_tokens == rows


def test_pipeline_depth_defaults_to_4_on_the_cpu_and_2_with_speculation_or_elsewhere(ckpt: Path, monkeypatch) -> None:
    """The CPU keeps 4 commands in flight (the parent may wait a scheduler slice for a core the
    child's threads fill); speculation's steps run in order, and an accelerator's parent has cores."""
    from l3worker.worker import distributed_worker as worker_module
    from l3worker.worker.arg_checks import default_pipeline_depth

    monkeypatch.setattr(worker_module, "ChildProcess", None)  # nothing starts before prepare()
    assert DistributedWorker(ckpt, **COMMON).pipeline_depth == 4
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert DistributedWorker(ckpt, **COMMON, speculative_config=ngram).pipeline_depth == 2
    assert DistributedWorker(ckpt, **COMMON, pipeline_depth=3).pipeline_depth == 3
    assert [default_pipeline_depth(kind, False) for kind in ("cpu", "cuda", "npu")] == [4, 2, 2]
    with pytest.raises(ValueError, match="pipeline_depth must be >= 1, got 0"):
        DistributedWorker(ckpt, **COMMON, pipeline_depth=0)


def test_page_size_defaults_to_the_devices_and_a_given_one_is_kept(ckpt: Path, monkeypatch) -> None:
    """Pages of 16 on the CPU (a repeated 128-token prompt hits 112 cached tokens; pages of 128
    would hit none), 128 on NPUs and GPUs."""
    from chip_child.device import default_page_size
    from l3worker.worker import distributed_worker as worker_module

    monkeypatch.setattr(worker_module, "ChildProcess", None)  # nothing starts before prepare()
    rest = {k: v for k, v in COMMON.items() if k != "page_size"}
    assert DistributedWorker(ckpt, **rest).runtime_config.page_size == 16
    assert DistributedWorker(ckpt, **rest, page_size=32).runtime_config.page_size == 32
    assert (default_page_size("cpu"), default_page_size("npu"), default_page_size("cuda")) == (16, 128, 128)
