"""Sampling features end to end: through the engine, the chip-child and the shared ring, against
plain references computed on transformers' fp32 logits of the same checkpoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from l3worker import DistributedWorker, SamplingParams


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("engine-sampling", seed=4)


@pytest.fixture(scope="module")
def worker(ckpt):
    with DistributedWorker(ckpt, max_batch_size=4, max_seq_len=128, page_size=8, max_num_batched_tokens=24) as w:
        yield w


@pytest.fixture(scope="module")
def logits_of(ckpt, hf_model):
    model = hf_model(ckpt)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    return run


PROMPT = [5, 17, 200, 3, 99, 42, 42, 7, 150, 8, 61, 23, 5, 17, 200, 9, 90, 33, 71, 12, 4, 250, 101, 6, 6, 30]


def test_logprobs_and_prompt_logprobs_match_log_softmax_of_transformers(worker, logits_of) -> None:
    out = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=5, prompt_logprobs=3))[0]
    ids = PROMPT + out.token_ids
    want = torch.log_softmax(logits_of(ids), dim=-1)
    # Prompt: entry j is token j given tokens 0..j-1; the prompt spans several chunks (budget 24).
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        lp = out.prompt_logprobs[j]
        assert lp.token_id == PROMPT[j]
        assert abs(lp.logprob - float(want[j - 1, PROMPT[j]])) < 1e-4
        top = torch.topk(want[j - 1], 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert np.allclose([v for _, v in lp.top], top.values.tolist(), atol=1e-4)
    # Generated (greedy: the distribution at temperature 1): the sampled token is the top one.
    for k, lp in enumerate(out.outputs[0].logprobs):
        row = want[len(PROMPT) + k - 1]
        assert lp.token_id == out.token_ids[k] == int(row.argmax())
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(row, 5).indices.tolist()


def test_scoring_a_prompt_with_no_new_tokens(worker, logits_of) -> None:
    out = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.finished
    want = torch.log_softmax(logits_of(PROMPT), dim=-1)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert np.allclose(got, [float(want[j - 1, PROMPT[j]]) for j in range(1, len(PROMPT))], atol=1e-4)


def reference_greedy(logits_of, prompt: list[int], n: int, *, presence=0.0, frequency=0.0, repetition=1.0,
                     temperature=1.0, min_p=0.0) -> list[int]:
    """Greedy under the documented penalty formulas, computed from transformers' logits."""
    out: list[int] = []
    for _ in range(n):
        x = logits_of(prompt + out)[-1].clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).float() if out else \
            torch.zeros_like(x)
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0).float()
        probs = torch.softmax(x / temperature, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("penalties", [dict(presence=1.5), dict(frequency=0.9), dict(repetition=1.8),
                                       dict(presence=0.5, frequency=0.4, repetition=1.3)])
def test_penalties_equal_the_reference_on_transformers_logits(worker, logits_of, penalties) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0),
                            repetition_penalty=penalties.get("repetition", 1.0))
    got = worker.generate([PROMPT], params)[0].token_ids
    assert got == reference_greedy(logits_of, PROMPT, 12, **penalties)
    plain = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert got != plain  # the penalty changed something, so the comparison means something


def test_min_p_keeps_the_top_token_and_seeded_draws_stay_inside_it(worker, logits_of) -> None:
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.5, min_p=0.3, seed=9)
    got = worker.generate([PROMPT], params)[0].token_ids
    for k, token in enumerate(got):
        probs = torch.softmax(logits_of(PROMPT + got[:k])[-1] / 1.5, dim=-1)
        assert float(probs[token]) >= 0.3 * float(probs.max()) - 1e-6
    assert worker.generate([PROMPT], params)[0].token_ids == got


def test_min_tokens_masks_stop_ids_until_reached(worker) -> None:
    first = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0].token_ids[0]
    stopped = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = worker.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[first], min_tokens=3))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_every_feature_gives_the_same_tokens_under_both_copy_policies(ckpt, worker) -> None:
    """copy_policy="always" re-sends every sampling parameter each decode step: the tokens and
    log-probabilities of featured requests equal the diff-only path's."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, presence_penalty=0.7, repetition_penalty=1.4,
                             logprobs=3),
              SamplingParams(max_new_tokens=10, temperature=0.9, min_p=0.1, seed=3, frequency_penalty=0.5),
              SamplingParams(max_new_tokens=10, stop_token_ids=[PROMPT[3]], min_tokens=6, temperature=0.7, seed=8)]
    prompts = [PROMPT, PROMPT[:9], PROMPT[5:]]
    want = worker.generate(prompts, params)
    with DistributedWorker(ckpt, max_batch_size=4, max_seq_len=128, page_size=8, max_num_batched_tokens=24,
                           copy_policy="always") as always:
        got = always.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [lp.top for lp in got[0].outputs[0].logprobs] == [lp.top for lp in want[0].outputs[0].logprobs]
