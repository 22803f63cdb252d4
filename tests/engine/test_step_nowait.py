"""Engine.step(wait=False), what a driver on an event loop calls (l3worker/serving/inline_engine.py):
it completes a step only once step_ready() says the child finished it, never sleeps idle, leaves a
queued control to a waiting step(), and driven so to the end gives generate()'s tokens, with
stream_interval too."""
from __future__ import annotations

import threading
import time

import pytest

from l3worker import DistributedWorker, SamplingParams

PROMPTS = [[5, 80, 17, 200, 3], [9, 9, 41, 7], [120, 3, 3, 56, 200, 11, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)


def drive_without_waiting(worker: DistributedWorker, params: SamplingParams) -> dict[str, list[int]]:
    """Every prompt, streamed, through step(wait=False) until all finish: each request's tokens."""
    engine = worker.engine
    ids = [engine.add_request(p, params, stream=True).request_id for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step(wait=False):
            tokens[out.request_id] += out.outputs[0].delta_token_ids
    return tokens


def test_a_step_that_never_completes_is_never_waited_for() -> None:
    """The child hangs in its 6th decode step: every later call returns at once, without it."""
    with DistributedWorker(None, max_batch_size=2, max_seq_len=256, page_size=16, num_threads=1,
                           fault_injection=["hang@5"], step_timeout_s=20.0) as w:
        engine = w.engine
        rid = engine.add_request(PROMPTS[0], GREEDY, stream=True).request_id
        got: list[int] = []

        def take() -> None:
            got.extend(t for o in engine.step(wait=False) if o.request_id == rid for t in o.outputs[0].delta_token_ids)

        deadline = time.monotonic() + 60  # a bound against hangs, not a timing assertion
        while len(got) < 6 and time.monotonic() < deadline:  # the prompt's token and 5 decode steps
            take()
        for _ in range(1000):
            take()
        assert len(got) == 6 and not engine.step_ready()


@pytest.mark.parametrize("stream_interval", [1, 3])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_driven_without_waiting_it_gives_generates_tokens(params, stream_interval) -> None:
    with DistributedWorker(None, max_batch_size=4, max_seq_len=256, page_size=16,
                           stream_interval=stream_interval) as w:
        expected = [list(o.outputs[0].token_ids) for o in w.generate(PROMPTS, params)]
        assert list(drive_without_waiting(w, params).values()) == expected


def test_nothing_in_flight_is_not_ready_and_a_control_waits_for_a_waiting_step() -> None:
    with DistributedWorker(None, max_batch_size=2, max_seq_len=256, page_size=16) as w:
        engine = w.engine
        engine.driven_by_loop_thread = True  # controls queue for the stepping thread, as a server's do
        assert not engine.step_ready() and engine.step(wait=False) == []  # idle: returns at once
        ran = threading.Event()
        caller = threading.Thread(target=lambda: engine.call_between_steps(ran.set))
        caller.start()
        try:
            while not engine.control_pending:
                caller.join(0.01)
            engine.step(wait=False)
            assert engine.control_pending and not ran.is_set()  # left for a step that may wait
            engine.step()
            assert ran.is_set() and not engine.control_pending
        finally:
            caller.join(30)
