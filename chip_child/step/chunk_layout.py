"""A step's prompt chunks on the host: the plan the runtime slices by, and the chunk ints.

Everything the device needs of a step's chunks (ids, positions, attention metadata, the rows
that start decoding, prompt-logprob targets) travels as one int64 buffer in one copy;
`ChunkLayout` is the one place that says where each part of it sits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from chip_child.protocol import Chunk
from chip_child.step.row_state import RowState


class ChunkInts(NamedTuple):
    """The parts of the chunk ints, in their order. T: chunk tokens, C: chunks, n: the step's
    lanes, L: chunks that end their prompt."""

    ids: object  # [T] the chunks' token ids
    positions: object  # [T]
    rows: object  # [T] each token's row
    query_starts: object  # [n + C + 1] each sequence's first packed index: the lanes, then the chunks
    seq_lens: object  # [C] each chunk's context length, its own tokens included
    seq_rows: object  # [n + C] each sequence's row, for its block table
    last_rows: object  # [L] rows whose prompt ends here
    last_index: object  # [L] the packed index of their last token
    targets: object  # the rest: prompt-logprob targets, chunk after chunk


@dataclass(frozen=True)
class ChunkLayout:
    tokens: int  # T
    chunks: int  # C
    lanes: int  # n
    last: int  # L

    @staticmethod
    def capacity(max_batch_size: int, prefill_capacity: int) -> int:
        """Ints a step can need: T and the targets at most the prefill capacity, n, C and L at
        most the batch (with room to spare)."""
        return 4 * prefill_capacity + 8 * max_batch_size + 2

    def _sizes(self) -> tuple[int, ...]:
        t, c, n, last = self.tokens, self.chunks, self.lanes, self.last
        return t, t, t, n + c + 1, c, n + c, last, last

    def pack(self, parts: ChunkInts) -> np.ndarray:
        for name, part, size in zip(ChunkInts._fields, parts, self._sizes()):
            if len(part) != size:
                raise ValueError(f"chunk ints: {name} has {len(part)} values, the layout {size}")
        return np.concatenate(parts).astype(np.int64)

    def unpack(self, ints):
        """Views of each part of `ints` (a device tensor or an array); targets run to its end."""
        views, at = [], 0
        for size in self._sizes():
            views.append(ints[at:at + size])
            at += size
        return ChunkInts(*views, ints[at:])


@dataclass
class ChunkPlan:
    """What the host knows of a step's prompt chunks: sizes for slicing the pooled buffers, the
    metadata's host lengths, and which rows start decoding after this step."""

    layout: ChunkLayout
    max_query_len: int
    query_lens: list[int]  # per sequence: the lanes, then the chunks
    seq_lens: list[int]
    penalized: list[tuple[int, int, int, int]]  # (row, first packed index, prompt tokens, output tokens)
    prompt_asks: list[tuple[int, int, int, int]]  # (first packed index, targets, staging offset, top N)


def plan_chunks(chunks: list[Chunk], staging: np.ndarray, rows: RowState, want_logprobs: bool,
                every_lane: bool = False) -> tuple[ChunkPlan, np.ndarray]:
    """Marks the rows whose prompt ends here as decoding from this step's sample on, and lays
    out the chunks' ids, positions and metadata after the lanes the forward runs: the plan, and
    the chunk ints for one copy to the device. Those lanes end at the highest row that decoded
    before this step (none on an idle engine): the lanes above it hold idle rows or rows whose
    prompt ends here, whose hidden state comes from their chunk. A 128-token prompt alone is then
    128 rows, not 129, which costs AMX's 16-row tiles a ninth tile. `every_lane`: all the step's
    lanes (speculation reads the forward's captures at those offsets)."""
    lens = [c.length for c in chunks]
    for c in chunks:
        if rows.active[c.row]:
            raise ValueError(f"chunk for row {c.row}, which is decoding")
    starts = np.cumsum([0] + lens[:-1])
    prompt_lens, prompt_tops = rows.host["prompt_lens"], rows.host["prompt_logprobs"]
    targets, asks, penalized = [], [], []
    for c, s in zip(chunks, starts):
        plen = int(prompt_lens[c.row])
        if rows.penalized[c.row]:
            in_prompt = max(0, min(c.start + c.length, plen) - c.start)
            penalized.append((c.row, int(s), in_prompt, c.length - in_prompt))
        top = int(prompt_tops[c.row])
        if want_logprobs and top >= 0 and c.start < plen - 1:
            count = min(c.start + c.length, plen - 1) - c.start
            if c.staging_offset + count >= len(staging):
                raise ValueError(f"chunk of row {c.row}: its prompt-logprob targets run past the staging slot")
            asks.append((int(s), count, c.staging_offset, top))
            targets.append(staging[c.staging_offset + 1:c.staging_offset + 1 + count])
    last = [(c, int(s)) for c, s in zip(chunks, starts) if c.last]
    decoding = np.flatnonzero(rows.active)
    # The input position a row's first sample counts from: its prompt's last.
    rows.start_decoding([c.row for c, _ in last], [c.start + c.length - 1 for c, _ in last])
    n = rows.facts().lanes if every_lane else int(decoding[-1]) + 1 if decoding.size else 0
    seq_lens = [c.start + c.length for c in chunks]
    layout = ChunkLayout(sum(lens), len(chunks), n, len(last))
    ints = layout.pack(ChunkInts(
        ids=np.concatenate([staging[c.staging_offset:c.staging_offset + c.length] for c in chunks]),
        positions=np.concatenate([np.arange(c.start, c.start + c.length) for c in chunks]),
        rows=np.repeat([c.row for c in chunks], lens),
        query_starts=np.concatenate([np.arange(n + 1), n + np.cumsum(lens)]),
        seq_lens=seq_lens,
        seq_rows=np.concatenate([np.arange(n), [c.row for c in chunks]]),
        last_rows=[c.row for c, _ in last],
        last_index=[n + s + c.length - 1 for c, s in last],
        targets=np.concatenate(targets) if targets else np.zeros(0, np.int64)))
    host_lens = rows.positions[:n] + 1
    return ChunkPlan(layout, max(lens), [1] * n + lens, host_lens.tolist() + seq_lens, penalized, asks), ints


def lane_hidden(hidden: torch.Tensor, forward_lanes: int, lanes: int) -> torch.Tensor:
    """The step's `lanes` rows of hidden state from a forward that ran `forward_lanes` of them
    first (plan_chunks): zeros above those, where only rows whose prompt ends here sample (their
    chunk's last token is copied in) and idle rows' samples are never read."""
    if forward_lanes == lanes:
        return hidden[:lanes]
    return torch.cat([hidden[:forward_lanes], hidden.new_zeros(lanes - forward_lanes, hidden.shape[1])])
