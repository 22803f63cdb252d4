"""A packed token axis of whole-row chunks, from host facts: what speculation's forwards run on.

Each sequence is one row's tokens at positions first .. first + q - 1, attending to that row's
pages (the target's block table: a draft model's cache uses the same page ids) and causally to
itself, through the chunked-prefill attention path. The host knows every length, so the
attention metadata carries host copies and everything crosses in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from chip_child.attention import AttentionMetadata


@dataclass
class PackedAxis:
    meta: AttentionMetadata
    positions: torch.Tensor  # [T] int64
    rows: torch.Tensor  # [T] int64: each token's row
    extra: torch.Tensor  # the int64 values given with it, copied in the same transfer
    last: np.ndarray  # [S] each sequence's last packed index (host)


def packed_axis(rows: np.ndarray, first: np.ndarray, q: np.ndarray, block_table: torch.Tensor, page_size: int,
                h2d: Callable[[np.ndarray], torch.Tensor], extra: np.ndarray | None = None) -> PackedAxis:
    """Sequences of q[i] tokens of row rows[i] from position first[i]; `extra` ints ride along."""
    extra = np.zeros(0, np.int64) if extra is None else extra
    t, s = int(q.sum()), len(rows)
    tok_pos = np.concatenate([np.arange(f, f + n) for f, n in zip(first, q)])
    seq_lens = first + q
    starts = np.concatenate([[0], np.cumsum(q)])
    ints = h2d(np.concatenate([tok_pos, np.repeat(rows, q), starts, seq_lens, rows, extra]).astype(np.int64))
    tok_pos_t, tok_rows_t = ints[:t], ints[t:2 * t]
    at = 2 * t
    starts_t, seq_lens_t = ints[at:at + s + 1], ints[at + s + 1:at + 2 * s + 1]
    rows_t = ints[at + 2 * s + 1:at + 3 * s + 1]
    slots = block_table[tok_rows_t, tok_pos_t // page_size].long() * page_size + tok_pos_t % page_size
    longest = int(seq_lens.max())
    meta = AttentionMetadata(starts_t.to(torch.int32), seq_lens_t.to(torch.int32),
                             block_table.index_select(0, rows_t)[:, :-(-longest // page_size)], slots, int(q.max()),
                             longest, query_lens_host=q.tolist(), seq_lens_host=seq_lens.tolist())
    return PackedAxis(meta, tok_pos_t, tok_rows_t, ints[at + 3 * s + 1:], starts[1:] - 1)
