"""What the speculative-decoding tests share: the workload (run plainly by conftest's `plain`
fixture), a workload of rows asking for log-probabilities, the check that the speculation
counters add up, and the n-gram lookup recomputed over whole histories (the proposer's oracle)."""
from __future__ import annotations

import numpy as np
import torch

from l3worker import DistributedWorker, SamplingParams

SMALL = dict(device="cpu", max_batch_size=4, max_seq_len=256, page_size=8)


def _repetitive(seed: int, period: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    unit = rng.integers(5, 250, period).tolist()
    return (unit * (length // period + 1))[:length]


# Rows that repeat, rows that do not, greedy and seeded, min_p, a stop id, min_tokens, penalties (a
# row that gets no drafts while the others speculate), and a prompt long enough to be prefilled in chunks.
PROMPTS = [_repetitive(1, 4, 23), list(range(30, 41)), _repetitive(2, 3, 40), [7, 8, 9],
           _repetitive(3, 5, 70), list(np.random.default_rng(4).integers(5, 250, 19))]
PARAMS = [SamplingParams(max_new_tokens=30, temperature=0.0),
          SamplingParams(max_new_tokens=21, temperature=0.9, top_k=20, min_p=0.05, seed=11),
          SamplingParams(max_new_tokens=27, temperature=0.0, stop_token_ids=[17]),
          SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=5),
          SamplingParams(max_new_tokens=25, temperature=0.0, min_tokens=6),
          SamplingParams(max_new_tokens=15, temperature=0.0, repetition_penalty=1.3)]

# Rows asking for log-probabilities (greedy with min_tokens' stop mask over a stop id it would
# sample early; seeded with top-k and min_p), a plain row, and a penalized one asking too (it
# gets no drafts): the batch test_speculative's log-probability tests run.
LP_PROMPTS = PROMPTS[0:1] + PROMPTS[2:3] + [_repetitive(3, 5, 30), PROMPTS[5]]
LP_PARAMS = [SamplingParams(max_new_tokens=30, temperature=0.0, logprobs=3, min_tokens=8, stop_token_ids=[249]),
             SamplingParams(max_new_tokens=26, temperature=0.8, seed=7, top_k=20, min_p=0.05, logprobs=5),
             SamplingParams(max_new_tokens=24, temperature=0.0),
             SamplingParams(max_new_tokens=18, temperature=0.0, repetition_penalty=1.3, logprobs=2)]
LP_ROWS = (0, 1)  # the rows that speculate and ask for log-probabilities


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_counts(w: DistributedWorker) -> dict:
    s = w.stats()["speculative"]
    m = w.engine.metrics
    assert s["num_drafts"] == m.value("l3worker:spec_decode_num_drafts_total")
    assert s["num_draft_tokens"] == m.value("l3worker:spec_decode_num_draft_tokens_total")
    assert s["num_accepted_tokens"] == m.value("l3worker:spec_decode_num_accepted_tokens_total")
    # Position j is accepted only after every position before it: counts never grow with j.
    per = s["accepted_per_position"]
    assert sum(per) == s["num_accepted_tokens"] and per == sorted(per, reverse=True)
    for j, n in enumerate(per):
        assert m.value("l3worker:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(j)}) == n
    assert s["num_accepted_tokens"] <= s["num_draft_tokens"] <= 3 * s["num_drafts"]
    # A verifying row makes 1 + its accepted tokens a step; every other token is counted undrafted
    # (more than the parent kept where a row stopped inside a step's tokens).
    assert s["num_undrafted_tokens"] == m.value("l3worker:spec_decode_num_undrafted_tokens_total")
    made = s["num_drafts"] + s["num_accepted_tokens"] + s["num_undrafted_tokens"]
    assert made >= m.value("l3worker:generation_tokens_total")
    return s


def ngram_drafts_reference(history: torch.Tensor, lengths: torch.Tensor, k: int, lookup_min: int,
                 lookup_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt-lookup rule recomputed over whole histories (the test oracle of
    chip_child.spec.ngram.NgramIndex). For each row of `history` [R, W] (its first `lengths` [R] entries are its tokens): the k
    tokens that followed the latest earlier occurrence of its last n tokens, the longest n in
    [lookup_min, lookup_max] that occurs, as drafts [R, k] (-1 past the count) and counts [R]."""
    r, w = history.shape
    dev = history.device
    drafts = torch.full((r, k), -1, dtype=torch.int64, device=dev)
    counts = torch.zeros(r, dtype=torch.int64, device=dev)
    found = torch.zeros(r, dtype=torch.bool, device=dev)
    for n in range(min(lookup_max, w - 1), lookup_min - 1, -1):
        starts = (lengths - n).clamp(min=0)
        pattern = history.gather(1, starts[:, None] + torch.arange(n, device=dev)[None, :])  # [R, n]
        windows = history.unfold(1, n, 1)  # [R, W - n + 1, n]: the n tokens from each start
        match = (windows == pattern[:, None, :]).all(-1)
        # A window must end before the row's last token, so at least one token follows it.
        index = torch.arange(windows.shape[1], device=dev)
        match &= index[None, :] < (lengths - n)[:, None]
        hit = match.any(1) & ~found
        latest = (match * (index[None, :] + 1)).argmax(1)  # the latest matching start
        follow = latest + n
        take = (lengths - follow).clamp(min=0, max=k)
        cols = (follow[:, None] + torch.arange(k, device=dev)[None, :]).clamp(max=w - 1)
        got = history.gather(1, cols)
        valid = torch.arange(k, device=dev)[None, :] < take[:, None]
        drafts = torch.where(hit[:, None] & valid, got, drafts)
        counts = torch.where(hit, take, counts)
        found |= hit
    return drafts, counts
