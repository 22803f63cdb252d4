"""Restart and resume: a chip-child that dies, raises or hangs costs a pause, not the requests.

The fault matrix through the public API with real processes. Each test checks that nothing is
lost (every output equals the undisturbed run's: greedy, seeded, and prompt logprobs) and nothing
is left behind (no child, socket directory or /dev/shm entry).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from fault_helpers import alive, assert_nothing_left, guard, shm_entries, wait_for
from l3worker import AsyncEngine, ChildDiedError, DistributedWorker, SamplingParams

SMALL = {"device": "cpu", "max_batch_size": 2, "max_seq_len": 96, "page_size": 8, "num_threads": 1,
         "step_timeout_s": 30.0}
LONG_PROMPT = list(range(3, 53))  # 50 tokens: four chunks of a 16-token step
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [200, 17, 9], LONG_PROMPT]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
SCORED = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=1)
PARAMS = [GREEDY, SEEDED, SCORED]


def _logprobs(entries, approx: bool) -> list | None:
    if entries is None:
        return None
    value = (lambda v: pytest.approx(v, abs=1e-4)) if approx else (lambda v: v)
    return [None if e is None else (e.token_id, value(e.logprob), [(i, value(v)) for i, v in e.top])
            for e in entries]


def outputs_of(outs, approx: bool = False) -> list[tuple]:
    """What must survive a restart: tokens, and the log-probabilities of prompt and tokens. With
    `approx`, log-probability values compare to float rounding: a resumed request is recomputed in
    batches of other shapes, as a preempted one is; ids compare exactly."""
    return [(o.token_ids, _logprobs(o.prompt_logprobs, approx), _logprobs(o.outputs[0].logprobs, approx),
             o.finish_reason, o.error) for o in outs]


@pytest.fixture(scope="module")
def undisturbed() -> list[tuple]:
    with DistributedWorker(**SMALL, max_num_batched_tokens=16) as w:
        return outputs_of(w.generate(PROMPTS, PARAMS), approx=True)


def restarts(w: DistributedWorker) -> int:
    return int(w.engine.metrics.value("l3worker:engine_restarts_total"))


class Watched:
    """A worker whose every generation of children is recorded, for the nothing-left check."""

    def __init__(self, **overrides):
        self.shm_before = shm_entries()
        self.worker = DistributedWorker(**{**SMALL, "max_num_batched_tokens": 16, **overrides}).prepare()
        self.socket_dir = self.worker.socket_dir
        self.children: list[psutil.Process] = []
        self.record()

    def record(self) -> None:
        known = {p.pid for p in self.children}
        self.children += [psutil.Process(pid) for pid in self.worker.child_pids if pid not in known]

    def generate_killing(self, sig: int, at_output: int, rank: int = 0) -> list:
        """Streams PROMPTS, sending `sig` to a child once `at_output` outputs arrived."""
        finals = {}
        for i, out in enumerate(self.worker.stream(PROMPTS, PARAMS)):
            if i == at_output:
                self.record()
                os.kill(self.worker.child_pids[rank], sig)
            if out.finished:
                finals[out.request_id] = out
        self.record()
        return [finals[k] for k in sorted(finals, key=int)]

    def close_and_check(self) -> None:
        self.record()
        self.worker.close()
        assert_nothing_left(self.children, self.socket_dir, self.shm_before)


def test_killed_mid_decode_resumes_every_request(undisturbed) -> None:
    w = Watched()
    with guard():
        outs = w.generate_killing(signal.SIGKILL, at_output=12)
        assert outputs_of(outs) == undisturbed
        assert restarts(w.worker) == 1 and w.worker.healthy
        assert outputs_of(w.worker.generate(PROMPTS, PARAMS)) == undisturbed  # and it goes on serving
    stats = w.worker.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    w.close_and_check()


def test_killed_mid_prefill_of_a_chunked_long_prompt(undisturbed) -> None:
    # The second prefill call exits: the long prompt is then part-way through its chunks.
    w = Watched(fault_injection="prefill:exit@1")
    with guard():
        assert outputs_of(w.worker.generate(PROMPTS, PARAMS)) == undisturbed
        assert restarts(w.worker) == 1
    w.close_and_check()


def test_killed_while_idle_is_noticed_at_the_next_request(undisturbed) -> None:
    w = Watched()
    with guard():
        os.kill(w.worker.child_pids[0], signal.SIGKILL)
        assert wait_for(lambda: not w.worker.healthy)
        assert outputs_of(w.worker.generate(PROMPTS, PARAMS)) == undisturbed
        assert restarts(w.worker) == 1
    w.close_and_check()


def test_child_raising_in_a_step_is_restarted(undisturbed) -> None:
    w = Watched(fault_injection="raise@2", overlap_steps=True)
    with guard():
        assert outputs_of(w.worker.generate(PROMPTS, PARAMS)) == undisturbed
        assert restarts(w.worker) == 1
    w.close_and_check()


def test_hung_child_times_out_and_is_restarted(undisturbed) -> None:
    w = Watched(step_timeout_s=2.0)
    with guard():
        outs = w.generate_killing(signal.SIGSTOP, at_output=12)
        assert outputs_of(outs) == undisturbed
        assert restarts(w.worker) == 1
        assert not alive(w.children[0])  # the stopped child was killed, not left behind
    w.close_and_check()


def test_failure_during_a_restarts_start_up_is_one_more_restart(undisturbed) -> None:
    # The first children exit mid-decode, the second ones during start-up, the third serve.
    w = Watched(fault_injection=["exit@3", "startup:exit@0"])
    with guard():
        assert outputs_of(w.worker.generate(PROMPTS, PARAMS)) == undisturbed
        assert restarts(w.worker) == 2
    w.close_and_check()


def test_failure_during_the_first_start_up_fails_prepare() -> None:
    shm_before = shm_entries()
    w = DistributedWorker(**SMALL, fault_injection="startup:exit@0")
    with guard(), pytest.raises(ChildDiedError, match="start-up"):
        w.prepare()
    assert w.stats()["state"] == "closed" and w.socket_dir is None
    assert wait_for(lambda: not (shm_entries() - shm_before))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_fault_during_shutdown_leaves_close_clean(sig: int) -> None:
    w = Watched()
    with guard():
        os.kill(w.worker.child_pids[0], sig)
        w.close_and_check()
    assert restarts(w.worker) == 0  # closing never restarts


def test_request_running_at_two_consecutive_failures_fails_alone(undisturbed) -> None:
    # One row: the first request runs at both failures and is given up; the second waits meanwhile.
    w = Watched(max_batch_size=1, fault_injection=["raise@3", "raise@1"])
    with guard():
        first, second = w.worker.generate(PROMPTS[:2], PARAMS[:2])
        assert first.error is not None and "2 consecutive chip-child failures" in first.error
        assert "injected fault" in first.error
        assert first.finish_reason == "abort" and len(first.token_ids) < GREEDY.max_new_tokens
        assert second.error is None and outputs_of([second]) == undisturbed[1:2]
        assert restarts(w.worker) == 2
        assert w.worker.engine.metrics.value("l3worker:request_success_total", {"finished_reason": "abort"}) == 1
    w.close_and_check()


def test_a_poison_request_in_a_full_batch_fails_alone(undisturbed) -> None:
    # Every start's prefill raises on a prompt that starts with token 250: the poison request
    # crashes its batch of four. Its companions become suspects, resume one at a time, and the
    # poison, a suspect still when it crashes again, is the only request failed.
    poison = [250, 5, 6, 7]
    w = Watched(max_batch_size=4, fault_injection=["prefill:raise@first=250"] * 4)
    with guard():
        *others, bad = w.worker.generate([*PROMPTS, poison], [*PARAMS, GREEDY])
        assert bad.error is not None and "injected fault" in bad.error and bad.finish_reason == "abort"
        assert outputs_of(others, approx=True) == undisturbed
        assert restarts(w.worker) == 2  # the batch's failure, then the poison's alone
        metrics = w.worker.engine.metrics
        assert metrics.value("l3worker:request_success_total", {"finished_reason": "abort"}) == 1
        assert metrics.value("l3worker:request_success_total", {"finished_reason": "length"}) == 3
    w.close_and_check()


def test_restarts_exhausted_fail_as_before() -> None:
    w = Watched(max_restarts=1, fault_injection=["exit@2", "exit@2"])
    with guard(), pytest.raises(ChildDiedError, match="code 3"):
        w.worker.generate(PROMPTS, PARAMS)
    w.record()
    assert restarts(w.worker) == 1 and w.worker.stats()["state"] == "closed"
    w.close_and_check()


def test_two_workers_side_by_side_one_child_killed(undisturbed) -> None:
    a, b = Watched(), Watched(max_batch_size=3, page_size=16)
    try:
        with guard():
            b_pids = b.worker.child_pids
            solo_b = outputs_of(b.worker.generate(PROMPTS, PARAMS), approx=True)
            assert outputs_of(a.generate_killing(signal.SIGKILL, at_output=5)) == undisturbed
            assert outputs_of(b.worker.generate(PROMPTS, PARAMS)) == solo_b
            assert restarts(a.worker) == 1 and restarts(b.worker) == 0 and b.worker.child_pids == b_pids
            assert a.socket_dir != b.socket_dir and os.path.isdir(b.socket_dir)
    finally:
        a.close_and_check()
        b.close_and_check()


def test_tensor_parallel_ranks_restart_together(make_checkpoint) -> None:
    path = str(make_checkpoint())
    params = [GREEDY, SEEDED, GREEDY]
    with DistributedWorker(path, **SMALL, device_ids=(0, 1)) as w:
        ref = [o.token_ids for o in w.generate(PROMPTS, params)]
    w = Watched(model_dir=path, device_ids=(0, 1))
    with guard():
        first = list(w.worker.child_pids)
        finals = {}
        for i, out in enumerate(w.worker.stream(PROMPTS, params)):
            if i == 8:
                os.kill(first[1], signal.SIGKILL)  # rank 1: rank 0 is left waiting in a collective
            if out.finished:
                finals[out.request_id] = out.token_ids
        w.record()
        assert [finals[k] for k in sorted(finals, key=int)] == ref
        assert restarts(w.worker) == 1 and not set(first) & set(w.worker.child_pids)
    w.close_and_check()


def test_async_engine_notices_an_idle_death_and_restarts(undisturbed) -> None:
    w = Watched()

    async def main() -> list:
        engine = AsyncEngine(w.worker)
        await engine.start()
        try:
            os.kill(w.worker.child_pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while restarts(w.worker) == 0 or not engine.healthy:  # with no request to send
                assert time.monotonic() < deadline, "the idle engine never restarted its dead child"
                await asyncio.sleep(0.05)
            w.record()
            finals = []
            for prompt, params in zip(PROMPTS, PARAMS):
                async for out in engine.generate(prompt, params):
                    pass
                finals.append(out)
            return finals
        finally:
            await engine.shutdown()

    with guard():
        assert outputs_of(asyncio.run(main())) == undisturbed
    w.close_and_check()
