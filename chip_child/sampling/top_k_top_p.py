"""Top-k and top-p as one cutoff logit a row: a row keeps every token whose tempered logit is at
least its cutoff, so tokens tied at the cutoff all stay (as transformers' top-k keeps them) and
the kept set does not depend on how a sort orders ties.

A row's cutoff is found among its largest logits, sorted (`cutoffs`). On the cpu those are its
top candidates from `torch.topk`: a full sort of a 151,936-token row takes about 16 ms there
(torch 2.13, one thread), topk of 1,024 about 1 ms. A row is sorted in full instead where a token
it keeps may lie past its candidates: one at or above its cutoff, or one tied with its k-th
largest (top-p's mass is over every token top-k keeps). Every quantity `cutoffs` computes on a
prefix of the sorted row that holds those tokens (a sequential cumsum, elementwise ops, the whole
row's softmax gathered) is the same on a longer prefix, so both ways give the same cutoff bits. Other devices sort in full: a sort is cheap
there, and the check for a row past its candidates would cost a host sync.

With every random row's kept set among its candidates, the Gumbel draw runs over the candidates
alone (`draw_among`): the noise of a (row, position, token) is a pure function of them, so it
picks the token that the draw over the whole masked row picks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chip_child.sampling.noise import noise_at

CANDIDATES = 1024  # a cpu row's candidates where one has top-p alone (else twice the largest top_k)
MAX_CANDIDATES = 16384  # past this (or half the vocabulary) a full sort is as cheap as topk
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Filtered:
    """Each row's cutoff [N] (-inf: keeps every token) and, where `complete`, its candidates:
    `values` [N, C] (its largest tempered logits, sorted down) and `ids` [N, C] hold every token
    it keeps."""

    cutoff: torch.Tensor
    values: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    complete: bool = False


def cutoffs(scaled: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor,
            top_p: torch.Tensor) -> torch.Tensor:
    """Each row's cutoff under top-k, then top-p over what top-k kept, from `values` [N, C] (a
    prefix of the row of `scaled` [N, V] sorted down) and their token `ids`. Needs C >= every
    filtering row's top_k. top_k 0 (or >= V) and top_p >= 1 turn a filter off; the most likely
    token always stays."""
    vocab, c = scaled.shape[-1], values.shape[-1]
    has_k = (top_k > 0) & (top_k < vocab)
    kth = values.gather(1, (top_k.clamp(1, c) - 1)[:, None]).squeeze(1)
    cut_k = torch.where(has_k, kth, NEG_INF)
    # Probabilities in sorted order: over what top-k kept (its mass a sequential cumsum, so the
    # same on any prefix that holds it), else the whole row's softmax at the candidates.
    # The cpu skips a form no row needs; elsewhere both are computed, for no host sync.
    any_k, all_k = (bool(has_k.any()), bool(has_k.all())) if scaled.device.type == "cpu" else (True, False)
    if any_k:
        e = (values - values[:, :1]).exp_().masked_fill_(values < cut_k[:, None], 0.0)
        probs = e.div_(e.cumsum(-1)[:, -1:])
    if not all_k:
        whole = scaled.softmax(-1).gather(1, ids)
        probs = torch.where(has_k[:, None], probs, whole) if any_k else whole
    # A token stays while the probability mass before it is below top_p.
    before = probs.cumsum(-1).sub_(probs)
    last = (before < top_p[:, None]).sum(-1).sub_(1).clamp_(0, c - 1)
    cut_p = values.gather(1, last[:, None]).squeeze(1)
    return torch.where(top_p < 1, torch.maximum(cut_p, cut_k), cut_k)


def filter_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                drawn: torch.Tensor | None = None) -> Filtered:
    """The rows' cutoffs; on the cpu from candidates where they hold each filtering row's kept set,
    else from full sorts of the rows they miss. `complete` when the candidates hold the kept set
    of every row that is `drawn` [N] bool (default: every row); the others' draws are not used."""
    vocab = scaled.shape[-1]
    has_k = (top_k > 0) & (top_k < vocab)
    filtering = has_k | (top_p < 1)
    covered = filtering if drawn is None else filtering | ~drawn

    def cut_from(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(filtering, cutoffs(scaled, values, ids, top_k, top_p), NEG_INF)

    if scaled.device.type != "cpu":
        return Filtered(cut_from(*scaled.sort(dim=-1, descending=True)))
    if scaled.shape[0] == 0:
        return Filtered(scaled.new_empty(0))
    k_max = int(torch.where(has_k, top_k, 0).max())
    # Twice the largest top_k: room past the k-th largest for the tokens tied with it. A row with
    # top-k keeps nothing past those; one with top-p alone needs CANDIDATES.
    c = max(2 * k_max, CANDIDATES if bool((filtering & ~has_k).any()) else 1)
    if c > MAX_CANDIDATES or 2 * c > vocab:
        values, ids = scaled.sort(dim=-1, descending=True)
        return Filtered(cut_from(values, ids), values, ids, bool(covered.all()))
    values, ids = scaled.topk(c, dim=-1)
    cut = cut_from(values, ids)
    # A kept token may lie past the candidates: one at or above the cutoff, or one tied with the
    # k-th largest (top-p's mass is over every token top-k keeps). Past an -inf candidate all are -inf.
    last = values[:, -1]
    kth = values.gather(1, (top_k.clamp(1, c) - 1)[:, None]).squeeze(1)
    past = ~(last < cut) | (has_k & (last >= kth))
    missed = filtering & past & (last > NEG_INF)
    if not bool(missed.any()):
        return Filtered(cut, values, ids, bool(covered.all()))
    rows = missed.nonzero().squeeze(1)
    sub = scaled[rows]
    full_values, full_ids = sub.sort(dim=-1, descending=True)
    cut[rows] = cutoffs(sub, full_values, full_ids, top_k[rows], top_p[rows])
    return Filtered(cut)


def mask_below(scaled: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """-inf wherever a row's logit is below its cutoff."""
    return scaled.masked_fill(scaled < cutoff[:, None], NEG_INF)


def draw_among(f: Filtered, keys: torch.Tensor, counters: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw over each row's kept candidates: the id that the draw over the whole
    row (noise + logits, -inf below the cutoff, the first largest) gives."""
    gumbel = noise_at(keys, counters, vocab_keys[f.ids]).log_().neg_().log_().neg_()
    score = gumbel.add_(f.values).masked_fill_(f.values < f.cutoff[:, None], NEG_INF)
    best = score.max(dim=-1, keepdim=True).values
    # Candidates come sorted by logit, not by id: of equal scores the smallest id wins, as in a row
    # (first_max), where a NaN counts as the largest.
    hit = (score == best) | (score.isnan() & best.isnan())
    return torch.where(hit, f.ids, f.ids.new_full((), torch.iinfo(f.ids.dtype).max)).min(-1).values
