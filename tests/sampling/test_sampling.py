"""Unit tests of chip_child.sampling.sampler: the top-k/top-p and min-p filters, the counter-based noise,
the distribution temperature sampling draws from, penalties, the stop-id mask and log-probabilities."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from chip_child.sampling.noise import torch_uniform_noise, vocab_hash
from chip_child.sampling.sampler import (
    Features,
    RowParams,
    apply_penalties,
    filter_min_p,
    filter_top_k_top_p,
    first_max,
    gumbel_noise,
    mask_stop_tokens,
    sample,
    sample_with_features,
    seed_key,
    token_logprobs,
    uniform_noise,
)
from chip_child.sampling import sampler
from chip_child.sampling.seeds import M32, hash32, unhash32

# Token ids ranked by logit: 1 (4.0), 4 (3.0), 3 (2.0), 0 (1.0), 2 (0.0).
# softmax probabilities in that order: 0.636, 0.234, 0.086, 0.032, 0.012.
LOGITS = torch.tensor([1.0, 4.0, 0.0, 2.0, 3.0])


def kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    out = filter_top_k_top_p(logits[None, :], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    assert torch.equal(out[out.isfinite()], logits[out.isfinite()])  # survivors keep their values
    return set(torch.nonzero(out.isfinite()).flatten().tolist())


@pytest.mark.parametrize("top_k,top_p,expected", [
    (0, 1.0, {0, 1, 2, 3, 4}),  # both filters off
    (1, 1.0, {1}),
    (2, 1.0, {1, 4}),
    (5, 1.0, {0, 1, 2, 3, 4}),
    (9, 1.0, {0, 1, 2, 3, 4}),  # k beyond the vocabulary
    (0, 0.5, {1}),  # the most likely token always stays
    (0, 0.8, {1, 4}),  # mass before token 3 is 0.870
    (0, 0.9, {1, 4, 3}),  # mass before token 0 is 0.956
    (0, 0.99, {1, 4, 3, 0, 2}),
    (3, 0.9, {1, 4}),  # after top-k the mass before token 3 is renormalised to 0.910
    (3, 0.95, {1, 4, 3}),
])
def test_filter_keeps_expected_tokens(top_k: int, top_p: float, expected: set[int]) -> None:
    assert kept(LOGITS, top_k, top_p) == expected


def test_filter_applies_per_row_parameters() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    out = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 1.0]))
    assert [set(torch.nonzero(r.isfinite()).flatten().tolist()) for r in out] == [{1, 4}, {3, 0}, {0, 1, 2, 3, 4}]


@pytest.mark.parametrize("vocab,scale", [(50, 2.0), (8192, 4.0), (8192, 1.0)])
def test_filter_agrees_with_transformers_warpers(vocab: int, scale: float) -> None:
    """Vocabulary 50: full sorts; 8,192: a row's candidates (scale 4), or past them (scale 1: the
    top-p rows are sorted in full)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g) * scale
    params = [(0, 0.7), (5, 1.0), (10, 0.5), (1, 0.3), (0, 0.95), (20, 0.9)]
    ours = filter_top_k_top_p(logits, torch.tensor([k for k, _ in params]), torch.tensor([p for _, p in params]))
    for row, (k, p) in enumerate(params):
        want = logits[row:row + 1]
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(ours[row].isfinite(), want[0].isfinite()), f"row {row} (top_k={k}, top_p={p})"


def test_the_largest_hash_gives_noise_below_one_and_no_sure_draw() -> None:
    """A token whose hash has all 24 noise bits set got noise 1.0 (the + 0.5 rounded up), so a
    Gumbel of +inf: drawn whatever its logit, outside top-k too (at 151,936 tokens, in about 1 in
    110 draws). Here token 7's key is made to hash to the largest value for this row."""
    keys, counters = torch.tensor([seed_key(3)]), torch.tensor([11])
    row = hash32(seed_key(3) ^ 11)
    vocab = torch.cat([vocab_hash(7, torch.device("cpu")), torch.tensor([unhash32(M32) ^ row])])
    assert hash32(int(vocab[7]) ^ row) == M32
    for noise in (uniform_noise(keys, counters, vocab), torch_uniform_noise(keys, counters, vocab)):
        assert noise.max() < 1 and noise[0, 7] == noise.max()
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0, 0, -100.0]])
    one = torch.ones(1)
    for top_k in (0, 1):  # the whole row's draw, and the draw among top-k candidates
        ids = sample(logits, one, torch.tensor([top_k]), one, keys, counters, vocab, True, top_k > 0)
        assert int(ids[0]) != 7


def test_noise_is_a_pure_function_of_key_counter_and_token() -> None:
    vocab = vocab_hash(64, torch.device("cpu"))
    keys = torch.tensor([seed_key(1), seed_key(2), seed_key(1)])
    counters = torch.tensor([5, 5, 5])
    noise = uniform_noise(keys, counters, vocab)
    assert ((noise > 0) & (noise < 1)).all()
    assert torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], uniform_noise(keys[:1], counters[:1] + 1, vocab)[0])
    # A row's noise does not depend on which other rows are in the batch.
    assert torch.equal(uniform_noise(keys[1:2], counters[1:2], vocab)[0], noise[1])


def test_seed_key_separates_large_seeds() -> None:
    keys = {seed_key(s) for s in (0, 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1)}
    assert len(keys) == 6
    assert all(0 <= k < 2**32 for k in keys)


def _draws(logits: torch.Tensor, temperature: float, top_k: int, keys: torch.Tensor,
           counters: torch.Tensor) -> torch.Tensor:
    n = keys.numel()
    rows = logits.expand(n, -1)
    return sample(rows, torch.full((n,), temperature), torch.full((n,), top_k), torch.ones(n), keys, counters,
                  vocab_hash(logits.numel(), torch.device("cpu")), any_random=True, any_filter=top_k > 0)


def _total_variation(ids: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(ids, minlength=probs.numel()).float() / ids.numel()
    return 0.5 * (freq - probs).abs().sum().item()


DRAWS = 4000


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_temperature_sampling_over_seeds_matches_softmax(temperature: float) -> None:
    keys = torch.tensor([seed_key(s) for s in range(DRAWS)])
    ids = _draws(LOGITS, temperature, 0, keys, torch.full((DRAWS,), 17))
    assert _total_variation(ids, (LOGITS / temperature).softmax(-1)) < 0.05


def test_sampling_along_one_sequence_matches_softmax() -> None:
    """One seed, successive positions: the counter alone must decorrelate the draws."""
    ids = _draws(LOGITS, 1.0, 0, torch.full((DRAWS,), seed_key(42)), torch.arange(DRAWS))
    assert _total_variation(ids, LOGITS.softmax(-1)) < 0.05


def test_top_k_sampling_matches_renormalised_softmax() -> None:
    keys = torch.tensor([seed_key(s) for s in range(DRAWS)])
    ids = _draws(LOGITS, 1.0, 3, keys, torch.zeros(DRAWS, dtype=torch.int64))
    want = torch.where(torch.isin(torch.arange(5), torch.tensor([1, 4, 3])), LOGITS, -torch.inf).softmax(-1)
    assert set(ids.tolist()) <= {1, 4, 3}
    assert _total_variation(ids, want) < 0.05


def test_greedy_rows_and_top_k_one_take_the_argmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    keys = torch.tensor([seed_key(s) for s in range(4)])
    args = (torch.tensor([0.0, 1.5, 0.0, 2.0]), torch.tensor([0, 1, 0, 0]), torch.ones(4), keys,
            torch.arange(4), vocab_hash(30, torch.device("cpu")))
    ids = sample(logits, *args, any_random=True, any_filter=True)
    argmax = logits.argmax(-1)
    assert ids[:3].tolist() == argmax[:3].tolist()
    assert sample(logits, *args, any_random=False, any_filter=False).tolist() == argmax.tolist()


def test_first_max_gives_argmaxs_index_on_ties_nan_and_all_minus_inf() -> None:
    """The sampler's argmax (numpy's on the cpu, faster) picks the first largest value, a NaN first
    of all, +inf before the rest, 0.0 and -0.0 as equals, and index 0 of a row that is all -inf,
    as torch's argmax does; on strided rows too."""
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        x = torch.randint(-3, 4, (4, 50), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[trial % 4, (trial * 7) % 50] = float("nan")
        if trial % 5 == 0:
            x[trial % 4] = float("-inf")
        if trial % 7 == 0:
            x[(trial + 1) % 4, (trial * 3) % 50] = float("inf")
        if trial % 11 == 0:
            x[x == 0] = -0.0
        assert torch.equal(first_max(x), x.argmax(-1))
        strided = x.t().contiguous().t()
        assert torch.equal(first_max(strided), x.argmax(-1))
    wide = torch.randn(16, 151936, generator=g)
    assert torch.equal(first_max(wide), wide.argmax(-1))


@pytest.mark.parametrize("min_p,expected", [
    (0.0, {0, 1, 2, 3, 4}),
    (0.01, {0, 1, 2, 3, 4}),  # 0.0064: every token is above it
    (0.1, {1, 4, 3}),  # 0.0636: token 0 (0.032) goes
    (0.3, {1, 4}),
    (0.5, {1}),
    (1.0, {1}),  # the most likely token always stays
])
def test_min_p_keeps_tokens_above_its_share_of_the_top_probability(min_p: float, expected: set[int]) -> None:
    out = filter_min_p(LOGITS[None, :], torch.tensor([min_p]))[0]
    assert set(torch.nonzero(out.isfinite()).flatten().tolist()) == expected
    assert torch.equal(out[out.isfinite()], LOGITS[out.isfinite()])


def test_penalties_follow_their_formulas_and_neutral_rows_keep_their_bits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.25, 1.0]] * 2)
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]] * 2)
    prompt = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]] * 2)
    out = apply_penalties(logits, counts, prompt, presence=torch.tensor([0.5, 0.0]),
                          frequency=torch.tensor([0.25, 0.0]), repetition=torch.tensor([2.0, 1.0]))
    # Token 0: output, positive: 2 / 2 - 0.25 * 2 - 0.5; token 1: output, negative: -1 * 2 - 0.25 - 0.5;
    # token 3: prompt only: -0.25 * 2; tokens 2 and 4: unseen.
    assert out[0].tolist() == [0.0, -2.75, 0.5, -0.5, 1.0]
    assert torch.equal(out[1], logits[1])


def test_stop_tokens_masked_only_for_rows_short_of_min_tokens() -> None:
    stop = torch.tensor([[False, True, False, True, False]] * 2)
    out = mask_stop_tokens(LOGITS.expand(2, -1), stop, torch.tensor([True, False]))
    assert out[0].isinf().tolist() == [False, True, False, True, False]
    assert torch.equal(out[1], LOGITS)


def test_token_logprobs_are_of_the_tempered_distribution_greedy_rows_at_temperature_one() -> None:
    logits = torch.stack([LOGITS, LOGITS])
    values, ids = torch.zeros(2, 1 + 3), torch.zeros(2, 3, dtype=torch.int64)
    token_logprobs(logits, torch.tensor([0.0, 0.5]), torch.tensor([4, 2]), 3, values, ids)
    for row, temperature, chosen in ((0, 1.0, 4), (1, 0.5, 2)):
        want = (LOGITS / temperature).log_softmax(-1)
        assert values[row, 0].item() == pytest.approx(want[chosen].item())
        assert ids[row].tolist() == [1, 4, 3]
        assert values[row, 1:].tolist() == pytest.approx(want[[1, 4, 3]].tolist())


def test_unused_stages_leave_seeded_draws_unchanged() -> None:
    g = torch.Generator().manual_seed(2)
    n, v = 6, 40
    logits = torch.randn(n, v, generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 2.0])
    top_k, top_p = torch.tensor([0, 0, 5, 0, 0, 3]), torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8, 1.0])
    keys, counters = torch.tensor([seed_key(s) for s in range(n)]), torch.arange(n) + 11
    vocab = vocab_hash(v, torch.device("cpu"))
    params = RowParams(temperature, top_k, top_p, keys, min_p=torch.zeros(n), presence=torch.zeros(n),
                       frequency=torch.zeros(n), repetition=torch.ones(n), min_pos=torch.zeros(n, dtype=torch.int64),
                       output_counts=torch.randint(0, 3, (n, v), generator=g).float(),
                       prompt_seen=(torch.rand(n, v, generator=g) < 0.3).float(),
                       stop_mask=torch.rand(n, v, generator=g) < 0.3)
    plain = sample(logits, temperature, top_k, top_p, keys, counters, vocab, any_random=True, any_filter=True)
    values, ids = torch.zeros(n, 21), torch.zeros(n, 20, dtype=torch.int64)
    every = sample_with_features(logits, params, counters, vocab, True, True,
                                 Features(penalties=True, min_p=True, stop_mask=True, logprobs=20), values, ids)
    assert torch.equal(plain, every)


def test_penalties_equal_the_plain_formula_bit_for_bit() -> None:
    """The float-only arithmetic of apply_penalties against the formula written with where()."""
    g = torch.Generator().manual_seed(3)
    n, v = 64, 200
    logits = torch.randn(n, v, generator=g) * 3
    logits[torch.rand(n, v, generator=g) < 0.05] = -torch.inf  # masked stop ids
    logits[torch.rand(n, v, generator=g) < 0.05] = 0.0
    counts = torch.randint(0, 4, (n, v), generator=g).float() * (torch.rand(n, v, generator=g) < 0.2)
    prompt = torch.rand(n, v, generator=g) < 0.1
    repetition = torch.cat([torch.rand(n - 8, generator=g) * 3 + 0.05, torch.ones(8)])
    frequency, presence = torch.randn(n, generator=g), torch.randn(n, generator=g)
    frequency[-8:], presence[-8:] = 0, 0  # the last rows are neutral
    seen = prompt | (counts > 0)
    rep = repetition[:, None]
    want = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    want = want - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    got = apply_penalties(logits, counts, prompt.float(), presence, frequency, repetition)
    assert torch.equal(got, want)
    assert torch.equal(got[-8:], logits[-8:])


@pytest.mark.parametrize("shape", [(1, 4096), (4, 4096), (2, 40_000)])  # one thread for the first two
def test_gumbel_noise_is_the_log_chain_on_one_thread_up_to_its_limit(monkeypatch, shape) -> None:
    """The same bits as -log(-log(u)) on every thread; small noise runs on one thread (MKL's log
    would wake the whole OpenMP team for it), and the thread count comes back after."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(0)).clamp_min(1e-7)
    want = u.clone().log_().neg_().log_().neg_()
    seen: list[int] = []
    real = torch.Tensor.log_
    monkeypatch.setattr(torch.Tensor, "log_", lambda t: seen.append(torch.get_num_threads()) or real(t))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = gumbel_noise(u.clone())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert seen == ([1, 1] if u.numel() <= sampler.ONE_THREAD_NOISE else [2, 2])
