"""A cpu decode step over its active lanes alone.

A step runs lanes [0, lanes): every row up to the highest active one (runtime.py). Rows finish in
any order, so the last streams of a batch often sit in high rows beside idle ones, and on the cpu
an idle lane costs as much as an active one (a 16-lane step with one row left took 55 ms, against
16 ms for that row in lane 0, on the 128M peers model). Where some lanes are idle, the forward
takes the active lanes' inputs packed and the logits go back to their lanes; the sampler then runs
over the lanes as before (an idle lane's id is never read). Each row's tokens are those of the
unpacked step: the kernels compute a row the same way whatever rows run beside it.

Off where the step's other inputs are per lane too (LoRA's adapter groups, speculation's hidden
states) and off the cpu (an accelerator runs captured graphs over fixed lanes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The decode inputs a forward reads per lane.
_PER_LANE = ("input_ids", "positions", "lane_seq_lens", "block_table", "slot_mapping")


@dataclass
class LiveLanes:
    inputs: dict[str, torch.Tensor]  # the _PER_LANE inputs of the active lanes, packed, and lane_starts
    index: torch.Tensor  # the active lanes, in order: where their logits go
    seq_lens_host: np.ndarray | None


def live_lanes(v: dict[str, torch.Tensor], active: np.ndarray, seq_lens_host: np.ndarray | None) -> LiveLanes | None:
    """The active lanes' inputs packed, or None where every lane of `v` is active (or none is)."""
    lanes = v["input_ids"].shape[0]
    if np.count_nonzero(active[:lanes]) in (0, lanes):  # the common case, without an index array
        return None
    live = np.flatnonzero(active[:lanes])
    index = torch.from_numpy(live)
    inputs = {name: v[name].index_select(0, index) for name in _PER_LANE}
    inputs["lane_starts"] = v["lane_starts"][:live.size + 1]  # one token per lane: 0, 1, ..., n
    return LiveLanes(inputs, index, None if seq_lens_host is None else seq_lens_host[live])
