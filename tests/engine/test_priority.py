"""scheduling_policy="priority" through the worker: a request that outranks the running ones
starts at the next step, everyone's greedy tokens stay what they are alone, and a priority under
"fcfs" is refused by name."""
from __future__ import annotations

import pytest

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams

SMALL = {"device": "cpu", "max_batch_size": 2, "max_seq_len": 128, "page_size": 8, "num_threads": 1}


def greedy(n: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, priority=priority)


def test_an_urgent_request_preempts_a_full_batch_and_every_output_stays_the_same(make_checkpoint) -> None:
    path = make_checkpoint()
    low_prompts, urgent_prompt = [[1, 2, 3], [4, 5, 6]], [7, 8, 9]
    with guard(), DistributedWorker(str(path), scheduling_policy="priority", **SMALL) as w:
        alone = [w.generate([p], greedy(40))[0].outputs[0].token_ids for p in low_prompts]
        urgent_alone = w.generate([urgent_prompt], greedy(8))[0].outputs[0].token_ids
        stream = w.stream(low_prompts, greedy(40, priority=10))
        next(stream)
        assert all(q.row >= 0 for s in w.engine.requests.values() for q in s.seqs)  # the batch is full
        urgent = w.engine.add_request(urgent_prompt, greedy(8, priority=0))
        sent = w.engine.scheduler.step
        while w.engine.scheduler.step == sent:  # the pipeline may be full: until the next command goes out
            next(stream)
        assert w.engine.scheduler.step == sent + 1 and urgent.seqs[0].row >= 0  # that command admitted it
        finals = {o.request_id: o.outputs[0].token_ids for o in stream if o.finished}
        assert w.engine.scheduler.num_preemptions >= 1
    assert sorted(finals.values()) == sorted(alone)
    assert urgent.seqs[0].tokens == urgent_alone


def test_a_priority_without_the_priority_policy_is_refused_by_name(make_checkpoint) -> None:
    with guard(), DistributedWorker(str(make_checkpoint()), **SMALL) as w:
        with pytest.raises(ValueError, match="scheduling_policy='priority'"):
            w.generate([[1, 2]], greedy(2, priority=1))
        assert len(w.generate([[1, 2]], greedy(2))[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        DistributedWorker(str(make_checkpoint()), scheduling_policy="lifo", **SMALL)
    with pytest.raises(TypeError, match="priority must be an int"):
        greedy(2, priority=1.5).validate(100)
