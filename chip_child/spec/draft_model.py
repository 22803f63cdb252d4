"""A draft model in the chip-child: a second checkpoint with the target's vocabulary proposes k
tokens per row, with its own paged K/V cache on the target's page ids.

The draft's cache holds, per row, valid K/V up to `valid[row]` (exclusive). A proposal first
catches a row up from the device-side token history (chip_child.spec.speculation) to its input token,
at most the step's token budget of positions a step (a row left behind gets no drafts until it
has caught up), and samples the first draft there; then k - 1 one-token forwards sample the others. Each draft is sampled with the row's own
sampling parameters and the sampler's hashed noise at its position, so a draft model equal to the
target proposes exactly the target's tokens. After verification only the positions whose tokens
were accepted stay valid; rejected ones are rewritten by a later catch-up. A row taken by a new
sequence keeps its prefix-cached positions: their pages hold the draft K/V written when they were
computed for the same ids (a position the draft never reached holds a stale value, which could
only cost acceptance, never tokens).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chip_child.attention import AttentionSpec, get_backend
from chip_child.models.loader import load_config, load_weights
from chip_child.models.qwen3 import Qwen3Weights, final_logits, forward, rope_table, shard_config
from chip_child.step.packed_axis import packed_axis
from chip_child.sampling.sampler import Features, sample_at_positions

if TYPE_CHECKING:
    from chip_child.step.host import StepHost


class DraftModel:
    def __init__(self, rt: "StepHost", model_dir: str, k: int):
        cfg = rt.cfg
        full = load_config(model_dir)
        if full.vocab_size != rt.model_cfg.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size {full.vocab_size} differs from the "
                             f"target's {rt.model_cfg.vocab_size}")
        self.rt = rt
        self.k = k
        self.model_cfg = shard_config(full, cfg.tp_size)
        host = load_weights(model_dir, full, rt.dtype, "cpu")
        self.weights = Qwen3Weights.from_hf(host, full, cfg.tp_rank, cfg.tp_size).to(rt.device)
        del host
        mc, b = self.model_cfg, cfg.max_batch_size
        self.rope = rope_table(mc, cfg.max_seq_len, rt.dtype, rt.device)
        self.capacity = cfg.prefill_capacity + b * k  # tokens of one draft forward at most
        spec = AttentionSpec(num_layers=mc.num_layers, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                             head_dim=mc.head_dim, num_pages=cfg.total_pages, page_size=cfg.page_size, dtype=rt.dtype,
                             max_tokens=self.capacity, max_seqs=2 * b, max_blocks=cfg.max_blocks_per_row)
        backend = get_backend(rt.device.type, cfg.attention_backend)
        options = {"decode_mirror": False} if backend.has_decode_mirror else {}
        self.attn = backend(spec, rt.device, **options).allocate()
        self.valid = np.zeros(b, np.int64)  # per row: positions whose draft K/V is valid
        self.budget = cfg.prefill_capacity  # catch-up tokens one step may run: the step's token budget
        self.catch_up_tokens = 0  # those the last proposal ran

    def admitted(self, rows: list[int], cached: list[int]) -> None:
        """New sequences' rows: the draft K/V of their prefix-cached positions is kept."""
        self.valid[rows] = cached

    def propose(self, rows: np.ndarray, pos: np.ndarray, room: np.ndarray, history: torch.Tensor,
                any_random: bool, any_filter: bool,
                features: Features | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """(drafts [R, k], drafts per row) for rows (input positions `pos`): room[i] of them for
        row i, -1 after."""
        rt, k = self.rt, self.k
        drafts = torch.full((len(rows), self.k), -1, dtype=torch.int64, device=rt.device)
        counts = np.zeros(len(rows), np.int64)
        go = np.flatnonzero(room > 0)
        if not go.size:
            return drafts, counts
        # Catch up to the input token (included) and sample the first draft after it, within the
        # step's token budget: the rows that need least first (a decoding row needs its input
        # token alone); a row left behind goes on at the next steps and drafts once caught up.
        done = np.minimum(self.valid[rows[go]], pos[go])
        need = pos[go] + 1 - done
        order = np.argsort(need, kind="stable")
        before = np.empty_like(need)
        before[order] = np.concatenate([[0], np.cumsum(need[order])[:-1]])
        end = done + np.minimum(need, np.maximum(self.budget - before, 0))
        self.catch_up_tokens = int((end - done).sum())
        while (left := end - done).any():
            part = np.minimum(left, max(1, self.capacity // len(go)))
            feed = np.flatnonzero(part > 0)
            axis = packed_axis(rows[go][feed], done[feed], part[feed], rt.state["block_table"], rt.cfg.page_size,
                               rt.h2d)
            tokens = history[axis.rows, axis.positions]
            hidden = self._forward(tokens, axis)
            ends = feed[done[feed] + part[feed] == pos[go][feed] + 1]  # rows whose input token was in this piece
            if ends.size:
                at = rt.h2d(axis.last[np.searchsorted(feed, ends)].astype(np.int64))
                index = rt.h2d(go[ends].astype(np.int64))
                drafts[index, 0] = self._sample(hidden.index_select(0, at), axis.rows[at], axis.positions[at],
                                                any_random, any_filter, features)
            done[feed] += part[feed]
        behind = done < pos[go] + 1
        self.valid[rows[go][behind]] = done[behind]
        go = go[~behind]
        counts[go] = room[go]
        for j in range(1, k):  # draft j + 1 from draft j, at position pos + j
            more = go[room[go] > j]
            if not more.size:
                break
            axis = packed_axis(rows[more], pos[more] + j, np.ones(len(more), np.int64), rt.state["block_table"],
                               rt.cfg.page_size, rt.h2d)
            index = rt.h2d(more.astype(np.int64))
            hidden = self._forward(drafts[index, j - 1], axis)
            drafts[index, j] = self._sample(hidden, axis.rows, axis.positions, any_random, any_filter, features)
        self._fed = (rows[go], pos[go], np.minimum(room[go], k) - 1)  # drafts fed after the input token
        return drafts, counts

    def accepted(self, rows: np.ndarray, accepted: np.ndarray) -> None:
        """After verification: positions pos .. pos + min(accepted, fed) hold accepted tokens' K/V."""
        fed_rows, pos, fed = self._fed
        got = dict(zip(rows.tolist(), accepted.tolist()))
        for row, p, f in zip(fed_rows.tolist(), pos.tolist(), fed.tolist()):
            self.valid[row] = p + min(got[row], f) + 1

    def _forward(self, tokens: torch.Tensor, axis) -> torch.Tensor:
        rt = self.rt
        return forward(self.model_cfg, self.weights, self.attn, self.attn.plan(axis.meta), self.rope, tokens,
                       axis.positions, rt.all_reduce, rt.ops)

    def _sample(self, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, any_random: bool,
                any_filter: bool, features: Features | None) -> torch.Tensor:
        """The row's own sampler at that position, min_p and min_tokens' stop mask included, as
        the target verifies: a draft equal to the target samples its tokens."""
        logits = final_logits(self.weights, hidden, ops=self.rt.ops)
        return sample_at_positions(logits, self.rt.state, rows, positions, any_random, any_filter, features)
