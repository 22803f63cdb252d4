"""chip_child.sampling.top_k_top_p: cutoffs found among a row's top candidates equal those of a
full sort, bit for bit; rows whose kept set reaches past the candidates are sorted in full; the
draw over the candidates picks what the draw over the whole masked row picks; ties at a cutoff
all stay; and a row's token does not depend on the rows beside it. (The kept sets against
transformers' warpers: test_sampling.py.)"""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper

from chip_child.sampling.noise import torch_uniform_noise, vocab_hash
from chip_child.sampling.sampler import first_max, sample, seed_key
from chip_child.sampling.top_k_top_p import CANDIDATES, cutoffs, draw_among, filter_rows, mask_below

VOCAB = 8 * CANDIDATES  # large enough that the cpu takes candidates rather than a full sort
PARAMS = [(20, 0.95), (0, 0.9), (50, 1.0), (0, 0.5), (1, 1.0), (40, 0.8), (0, 1.0), (7, 0.3)]


def _logits(rows: int, scale: float, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Peaked rows (a trained model's shape: a nucleus of tens of tokens at scale 4)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _params(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ks, ps = zip(*(PARAMS[i % len(PARAMS)] for i in range(n)))
    return torch.tensor(ks), torch.tensor(ps)


def _full_sort_cutoffs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    values, ids = x.sort(dim=-1, descending=True)
    filtering = ((top_k > 0) & (top_k < x.shape[-1])) | (top_p < 1)
    return torch.where(filtering, cutoffs(x, values, ids, top_k, top_p), float("-inf"))


def _draw_over_whole_rows(x, cutoff, keys, counters, vocab_keys=None) -> torch.Tensor:
    """The reference draw: noise over every token, logits below the cutoff at -inf, the first max."""
    vocab_keys = vocab_hash(x.shape[-1], x.device) if vocab_keys is None else vocab_keys
    gumbel = torch_uniform_noise(keys, counters, vocab_keys).log().neg().log().neg()
    return first_max(gumbel + mask_below(x, cutoff))


@pytest.mark.parametrize("scale", [4.0, 1.0, 0.05])
def test_cutoffs_from_candidates_equal_a_full_sorts(scale: float) -> None:
    """Scale 4: kept sets fit the candidates; 1 and 0.05: top-p rows' nuclei reach past them and
    are sorted in full. The cutoffs are the same bits either way."""
    x = _logits(16, scale)
    top_k, top_p = _params(16)
    got = filter_rows(x, top_k, top_p, drawn=(top_k > 0) | (top_p < 1))  # the unfiltered row is greedy
    assert torch.equal(got.cutoff, _full_sort_cutoffs(x, top_k, top_p))
    assert got.complete == (scale == 4.0)
    assert not filter_rows(x, top_k, top_p).complete  # a drawn row without filters needs the whole row


def test_a_batch_of_top_k_rows_takes_twice_its_largest_k_as_candidates() -> None:
    """Qwen3's defaults (top_k 20, top_p 0.95) on bf16 logits, which tie often: 40 candidates a
    row hold what each keeps, and the cutoffs are a full sort's."""
    x = _logits(16, 4.0, seed=9).bfloat16().float()
    top_k, top_p = torch.full((16,), 20), torch.full((16,), 0.95)
    top_k[3], top_p[5] = 7, 1.0
    got = filter_rows(x, top_k, top_p)
    assert got.complete and got.values.shape[1] == 40
    assert torch.equal(got.cutoff, _full_sort_cutoffs(x, top_k, top_p))


def test_tokens_tied_at_the_cutoff_all_stay() -> None:
    """bf16 logits tie often: top_k 20 keeps every token equal to the 20th largest, as
    transformers' TopKLogitsWarper does, so the kept set is more than 20 here."""
    x = (_logits(1, 3.0, seed=2)).bfloat16().float()
    x[0, :30] = 20.0  # thirty tokens tied for first place (the rest stay below 16)
    got = mask_below(x, filter_rows(x, torch.tensor([20]), torch.tensor([1.0])).cutoff).isfinite()
    assert got.sum() == 30
    assert torch.equal(got[0], TopKLogitsWarper(20)(None, x)[0].isfinite())


def test_a_tie_running_past_the_candidates_is_sorted_in_full() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 5] = 1.0
    got = filter_rows(x, torch.tensor([3]), torch.tensor([1.0]))  # the 3rd largest is 0.0: all tie
    assert not got.complete
    assert torch.equal(got.cutoff, torch.tensor([0.0]))


def test_a_tie_at_the_kth_largest_past_the_candidates_counts_in_top_p() -> None:
    """top_k 2 keeps the first token and 2,000 tied at 0.0, most of them past the candidates;
    top_p 0.5 over what top-k kept then keeps them all (the first holds 0.41 of the mass)."""
    x = torch.full((1, VOCAB), -30.0)
    x[0, 0] = math.log(1400.0)
    x[0, 1:2001] = 0.0
    got = filter_rows(x, torch.tensor([2]), torch.tensor([0.5]))
    assert torch.equal(got.cutoff, torch.tensor([0.0])) and not got.complete
    assert torch.equal(got.cutoff, _full_sort_cutoffs(x, torch.tensor([2]), torch.tensor([0.5])))


def test_a_row_of_few_allowed_tokens_is_not_sorted_in_full() -> None:
    """A grammar's row: 50 tokens allowed, the rest -inf. top_k 100 keeps them all (its cutoff is
    -inf), and past the candidates every logit is -inf: the candidates hold the row."""
    x = torch.full((1, VOCAB), float("-inf"))
    x[0, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:50]] = torch.randn(50)
    got = filter_rows(x, torch.tensor([100]), torch.tensor([1.0]))
    assert got.complete and torch.equal(got.cutoff, _full_sort_cutoffs(x, torch.tensor([100]), torch.tensor([1.0])))


def test_a_nan_logit_is_drawn_as_the_whole_row_draws_it() -> None:
    """first_max counts a NaN as the largest: the candidate draw must return its id, not a sentinel."""
    x = _logits(1, 4.0, seed=7)
    x[0, 123] = float("nan")
    vocab = vocab_hash(VOCAB, x.device)
    for top_k, top_p in ((20, 1.0), (20, 0.9), (0, 0.9)):
        ids = sample(x, torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([seed_key(1)]),
                     torch.tensor([5]), vocab, True, True)
        assert int(ids[0]) == 123, (top_k, top_p)


def test_of_equal_scores_the_smallest_id_is_drawn() -> None:
    """Tokens 10 and 3000 get one vocab key, so the same noise, and the same logit: a tie, which
    the whole row's draw gives to the smaller id."""
    x = _logits(1, 0.1, seed=8)
    x[0, 10] = x[0, 3000] = 50.0
    vocab = vocab_hash(VOCAB, x.device).clone()
    vocab[3000] = vocab[10]
    f = filter_rows(x, torch.tensor([5]), torch.tensor([1.0]))
    assert f.complete
    keys, counters = torch.tensor([seed_key(2)]), torch.tensor([1])
    assert int(draw_among(f, keys, counters, vocab)[0]) == 10
    assert torch.equal(draw_among(f, keys, counters, vocab), _draw_over_whole_rows(x, f.cutoff, keys, counters, vocab))


def test_an_empty_batch_samples_nothing() -> None:
    empty = torch.zeros(0)
    ids = sample(torch.zeros(0, VOCAB), empty, empty.long(), empty, empty.long(), empty.long(),
                 vocab_hash(VOCAB, torch.device("cpu")), True, True)
    assert ids.shape == (0,)


def test_draw_among_candidates_equals_the_draw_over_whole_rows() -> None:
    n = 64
    x = _logits(n, 4.0, seed=3)
    top_k, top_p = _params(n)
    top_p[top_k == 0] = torch.where(top_p[top_k == 0] < 1, top_p[top_k == 0], 0.9)  # every row filters
    keys = torch.tensor([seed_key(s) for s in range(n)])
    counters = torch.arange(n) * 7 + 100
    f = filter_rows(x, top_k, top_p)
    assert f.complete
    got = draw_among(f, keys, counters, vocab_hash(VOCAB, x.device))
    assert torch.equal(got, _draw_over_whole_rows(x, f.cutoff, keys, counters))
    assert len(set(got.tolist())) > 1  # the draws are not all the argmax


def test_a_row_samples_the_same_token_whatever_shares_its_batch() -> None:
    """A filtered row alone (candidate draw), beside an unfiltered random row (whole-row draw, its
    own kept set from candidates) and beside a row past its candidates (full sorts): same token."""
    vocab = vocab_hash(VOCAB, torch.device("cpu"))
    row = _logits(1, 4.0, seed=4)
    wide = _logits(1, 0.05, seed=5)
    batches = {
        "alone": (row, [20], [0.95]),
        "beside an unfiltered row": (torch.cat([row, wide]), [20, 0], [0.95, 1.0]),
        "beside a row past its candidates": (torch.cat([row, wide]), [20, 0], [0.95, 0.95]),
    }
    for position in range(50):
        picks = {}
        for name, (x, k, p) in batches.items():
            n = len(x)
            ids = sample(x, torch.ones(n), torch.tensor(k), torch.tensor(p), torch.full((n,), seed_key(9)),
                         torch.full((n,), position), vocab, any_random=True, any_filter=True)
            picks[name] = int(ids[0])
        assert len(set(picks.values())) == 1, (position, picks)


def test_greedy_rows_beside_filtered_rows_keep_the_argmax() -> None:
    x = _logits(2, 4.0, seed=6)
    ids = sample(x, torch.tensor([0.0, 1.0]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]),
                 torch.tensor([seed_key(1), seed_key(2)]), torch.tensor([3, 3]), vocab_hash(VOCAB, x.device),
                 any_random=True, any_filter=True)
    assert int(ids[0]) == int(x[0].argmax())
    assert int(ids[1]) in set(x[1].topk(20).indices.tolist())
