"""The n-gram proposer's index, on the host and incremental: per row, its token ids and, for each
n in [lookup_min, lookup_max], the position that followed each n-gram's latest occurrence.

Each token a row takes in (prompt chunks, a prefix-cache hit's ids, the tokens a step produced)
registers the n-grams it completes: the work per token is one dict entry per n, and a proposal
is at most (lookup_max - lookup_min + 1) look-ups, whatever the history's length. The drafts are
the tokens that followed the latest earlier occurrence of the row's last n tokens, for the longest
n that occurred (vLLM's prompt-lookup rule); the device never waits for them."""
from __future__ import annotations

import numpy as np


class NgramIndex:
    def __init__(self, rows: int, max_len: int, lookup_min: int, lookup_max: int):
        self.lookup = range(lookup_max, lookup_min - 1, -1)  # longest first
        self.ids = np.zeros((rows, max_len + 1), np.int64)
        self.length = np.zeros(rows, np.int64)  # ids known per row
        self.follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(rows)]  # n-gram -> position after

    def reset(self, row: int) -> None:
        """A new sequence takes the row."""
        self.length[row] = 0
        self.follow[row] = {}

    def put(self, row: int, start: int, ids) -> None:
        """The row's ids at positions start..; positions it already holds are final and kept."""
        ids = np.asarray(ids, np.int64)
        first = int(self.length[row])
        if start + len(ids) <= first:
            return
        if start > first:
            raise ValueError(f"row {row}: ids from position {start}, but it holds {first}")
        new = ids[first - start:]
        self.ids[row, first:first + len(new)] = new
        seq, follow = self.ids[row], self.follow[row]
        for p in range(max(first, 1), first + len(new)):  # the n-grams ending at p - 1 are followed by p
            for n in self.lookup:
                if n <= p:
                    follow[tuple(seq[p - n:p].tolist())] = p
        self.length[row] = first + len(new)

    def propose(self, row: int, k: int) -> np.ndarray:
        """Up to k drafts for the row's next positions (none when no n-gram of its tail recurs)."""
        length, seq, follow = int(self.length[row]), self.ids[row], self.follow[row]
        for n in self.lookup:
            if n < length:
                at = follow.get(tuple(seq[length - n:length].tolist()))
                if at is not None:
                    return seq[at:min(at + k, length)]
        return seq[:0]
