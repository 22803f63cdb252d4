"""stream_interval (vLLM's): streamed deltas of N tokens, and N decode steps read per wake-up."""
from __future__ import annotations

import random

import pytest

from l3worker import DistributedWorker, SamplingParams

MAX_TOKENS = 41


def make_worker(**kw) -> DistributedWorker:
    return DistributedWorker(**(dict(max_batch_size=4, max_seq_len=256, page_size=16) | kw))


@pytest.fixture(scope="module")
def every_token():
    with make_worker() as w:
        yield w


@pytest.fixture(scope="module")
def by_four():
    with make_worker(stream_interval=4) as w:
        yield w


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)]


def streamed(worker: DistributedWorker, ps: list[list[int]], params: SamplingParams) -> dict:
    """Per (request, sample): the token count of each delta, and the tokens they add up to."""
    sizes: dict[tuple[str, int], list[int]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for out in worker.stream(ps, params):
        for c in out.outputs:
            key = (out.request_id, c.index)
            if c.delta_token_ids:
                sizes.setdefault(key, []).append(len(c.delta_token_ids))
            tokens.setdefault(key, []).extend(c.delta_token_ids)
    return {"sizes": sizes, "tokens": sorted(tokens.values())}


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded_n2"])
def test_the_engines_interval_streams_n_tokens_a_delta_and_the_same_tokens(every_token, by_four, params) -> None:
    ps = prompts(3)
    grouped, plain = streamed(by_four, ps, params), streamed(every_token, ps, params)
    assert grouped["tokens"] == plain["tokens"]  # what is generated does not change, only how it is delivered
    for sizes in grouped["sizes"].values():
        assert sum(sizes) == MAX_TOKENS and sizes[0] == 1  # the first token is never held back
        assert all(size >= 4 for size in sizes[1:-1]), sizes
    assert all(sizes == [1] * MAX_TOKENS for sizes in plain["sizes"].values())
    ids = {(o.request_id, c.index): c.token_ids for o in by_four.generate(ps, params) for c in o.outputs}
    assert sorted(ids.values()) == plain["tokens"]  # offline, too


def test_stop_strings_and_logprobs_end_where_they_would_streaming_every_token(every_token, by_four) -> None:
    """A stop string met inside a group of four steps ends the sample at that token, the tokens
    after it in the group dropped; logprobs travel with their tokens."""
    ps = prompts(2)
    base = SamplingParams(temperature=0.9, seed=8, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    text = every_token.generate(ps[:1], base)[0].outputs[0].text
    params = SamplingParams(temperature=0.9, seed=8, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                            stop=[text[len(text) // 2:len(text) // 2 + 2]])
    got = {w: [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                [(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs])
               for o in w.generate(ps, params)] for w in (every_token, by_four)}
    assert got[by_four] == got[every_token]
    assert got[by_four][0][2] == "stop" and len(got[by_four][0][1]) < MAX_TOKENS


def test_preempted_and_resumed_rows_give_the_same_tokens(every_token) -> None:
    ps, params = prompts(4), PARAMS[1]
    with make_worker(stream_interval=4, num_pages=12, enable_prefix_caching=False) as w:
        got = [c.token_ids for o in w.generate(ps, params) for c in o.outputs]
        assert w.engine.scheduler.num_preemptions > 0
    assert got == [c.token_ids for o in every_token.generate(ps, params) for c in o.outputs]


def test_a_requests_interval_holds_its_deltas_to_n_tokens(every_token) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stream_interval=3)
    got = streamed(every_token, prompts(2), params)
    for sizes in got["sizes"].values():  # one step at a time here: exactly 3 a delta, the rest at the end
        assert sizes == [1] + [3] * 13 + [1], sizes
    again = streamed(every_token, prompts(2), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got["tokens"] == again["tokens"]


def test_a_requests_interval_below_the_engines_is_raised_to_it(by_four) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stream_interval=2)
    for sizes in streamed(by_four, prompts(1), params)["sizes"].values():
        assert all(size >= 4 for size in sizes[1:-1]), sizes


def test_n_decode_steps_are_read_per_call_of_step(by_four) -> None:
    """The loop completes four decode steps per wake-up: a lone request's 41 tokens take its
    prefill step, ten calls of four, and at most the pipeline's tail one at a time, instead of
    41 calls (a delta-only interval would still wake once a step)."""
    engine = by_four.engine
    assert by_four.pipeline_depth == 5  # four read at once, and one more for the child meanwhile
    engine.add_request(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    calls, tokens = 0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        calls += 1
        tokens = max([len(o.outputs[0].token_ids) for o in outputs if o.finished] + [tokens])
    assert tokens == MAX_TOKENS
    assert calls <= 1 + MAX_TOKENS // 4 + 4, calls


def test_bad_intervals_are_refused_by_name(every_token) -> None:
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        make_worker(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        every_token.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stream_interval=0))
    with pytest.raises(TypeError, match="stream_interval"):
        every_token.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stream_interval=2.5))
    assert every_token.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids  # still serving
