"""Speculative decoding in the chip-child: drafts verified as k + 1 tokens per row.

Each row's token history (prompt and every token it produced; the ids a prefix-cache hit let its
chunks skip come with its admit) is kept on the device. A speculative step proposes, for every
active row, up to k tokens, by n-gram lookup in that history, from a draft model
(chip_child.spec.draft_model) or from an EAGLE-3 head (chip_child.spec.eagle3), then runs one forward over
a packed axis holding, per row, its input token and its drafts (the chunked-prefill attention
path: each row is a chunk attending to its pages and causally to itself). The target samples
at every position with the sampler's hashed noise of (seed, position, token), so the token it
samples there is fixed by its logits: a draft is accepted exactly when it equals that token, and
the first mismatch is replaced by the target's own. Output is identical to plain decoding,
greedy or seeded.

A row then moves on by its accepted count + 1: positions, the next input id and the history are
updated on the device, the counts also on the host (the step's one synchronisation, as the
sampled ids are for a plain step), since the next step's attention metadata needs them. K/V
written at rejected positions is overwritten by later steps before anything reads it.

Drafts never run past a row's max_new_tokens, and a row that reached it stops being active
here (the parent, which schedules ahead without knowing acceptance, may still send steps for
it). Steps with prompt chunks run as plain steps: every row then moves on by one token. min_p and
min_tokens' stop mask depend on a position alone and are applied at every verified position.
So are log-probabilities: a row asking for them gets, at every verified position, those of the
distribution a plain step would sample from there; the first position's go where a plain step
leaves them, the others to the ring's per-position entries (StepOutputs.spec_logprobs), so the
parent takes one entry per token it takes. A row using penalties or a grammar gets no drafts:
its state moves with every token. It is a chunk of one token in the verify step, sampled with its
stages (and its penalty counts, log-probabilities and grammar advanced) exactly as a plain step
would, while the other rows speculate beside it.

Under copy_policy="always" the full state leaves out positions and slots: acceptance moves them
on the device, so like the KV cache and the penalty counts they are device state, and the host,
which schedules ahead of acceptance, could only send stale ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chip_child.step.chunk_layout import ChunkPlan
from chip_child.spec.draft_model import DraftModel
from chip_child.spec.ngram import NgramIndex
from chip_child.spec.eagle3 import Eagle3Head, eagle3_proposer
from chip_child.models.qwen3 import final_logits, forward
from chip_child.step.packed_axis import packed_axis
from chip_child.step.row_fields import MAX_LOGPROBS
from chip_child.step.row_state import BatchFacts
from chip_child.sampling.sampler import Features, RowParams, sample_at_positions, sample_with_features
from chip_child.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from chip_child.step.host import StepHost
    from chip_child.step.results import StepOutputs


class Speculation:
    """The runtime's speculative state: row histories, the last step's per-row tokens and
    counts, and the verify step (registered as the callable "verify")."""

    def __init__(self, rt: "StepHost", config: SpeculativeConfig):
        self.rt = rt
        self.config = config
        self.k = config.num_speculative_tokens
        b, s = rt.cfg.max_batch_size, rt.cfg.max_seq_len
        dev = rt.device
        self.scratch = s  # history column idle lanes write to
        self.history = torch.zeros(b, s + 1, dtype=torch.int64, device=dev)
        self.step_ids = torch.zeros(b, self.k + 1, dtype=torch.int64, device=dev)  # each row's tokens of the last step
        self.counts = np.zeros(b, np.int32)  # tokens each row produced in the last step (0: none)
        self._proposal: tuple | None = None  # propose()'s drafts, for the verify step that follows
        self.drafted = np.zeros(b, np.int32)  # drafts each row verified in the last step
        # Log-probabilities of each row's tokens 0..k of the last verify step (token 0's also go
        # to the runtime's lp_values, as a plain step's), and their N (-1: that step computed none).
        self.lp_values = torch.zeros(b, self.k + 1, 1 + MAX_LOGPROBS, device=dev)
        self.lp_ids = torch.zeros(b, self.k + 1, MAX_LOGPROBS, dtype=torch.int64, device=dev)
        self.lp_n = -1
        # ngram: host-side and incremental (chip_child.spec.ngram); its ids arrive with each step
        self.ngram = NgramIndex(b, s, config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self._sampled_rows: tuple[np.ndarray, np.ndarray] | None = None  # (rows, positions) a plain step sampled
        proposers = {"draft_model": DraftModel, "eagle3": eagle3_proposer}
        self.draft = proposers[config.method](rt, config.model, self.k) if config.method in proposers else None
        rt.register_callable("verify", self.verify)

    # -- which steps speculate --------------------------------------------------------------------
    @staticmethod
    def applies(plan: ChunkPlan | None, facts: BatchFacts) -> bool:
        """Whether a step may speculate: decode-only with an active row (host facts alone, so
        tensor-parallel ranks agree)."""
        return plan is None and facts.any_active

    def _undrafted(self, act: np.ndarray) -> np.ndarray:
        """Which of the rows `act` get no drafts: penalized rows and rows held to a grammar, whose
        state moves with every token. (min_p, min_tokens' stop mask and log-probabilities are
        verified token by token.)"""
        rows = self.rt.rows
        return rows.penalized[act] | rows.constrained[act]

    # -- bookkeeping around a plain step ----------------------------------------------------------
    def aux(self) -> tuple[tuple[int, ...], dict] | None:
        """What a plain step's target forward captures for an EAGLE-3 head (None: nothing)."""
        return self.draft.capturing() if isinstance(self.draft, Eagle3Head) else None

    def after_plain_step(self, lanes: int, plan: ChunkPlan | None, chunks: list, host_ints: np.ndarray | None) -> None:
        """A plain step ran (every active row moved on by one): the chunks' ids and the sampled
        ids join the histories (the n-gram index takes the sampled ones once they are on the host:
        `sampled`); each active row produced one token; an EAGLE-3 head catches up."""
        rt, v = self.rt, self.rt.lane_views[lanes]
        ids = None
        if plan is not None:
            ints = plan.layout.unpack(rt.prefill_state["chunk_ints"])
            self.history[ints.rows, ints.positions] = ints.ids
            ids = ints.ids
            if self.ngram is not None:
                host = plan.layout.unpack(host_ints)
                for c in chunks:  # a chunk's ids are contiguous positions of one row
                    at = np.flatnonzero(host.rows == c.row)
                    self.ngram.put(c.row, int(host.positions[at[0]]), host.ids[at])
        if self.ngram is not None:
            act = np.flatnonzero(rt.rows.active[:lanes])
            self._sampled_rows = (act, rt.rows.positions[act].copy())
        if isinstance(self.draft, Eagle3Head):
            rows = rt.rows
            decoded = np.where(rows.active[:lanes], rows.positions[:lanes] - 1, -1)  # positions have advanced
            decoded[[c.row for c in chunks if c.last]] = -1  # a prompt that ended here: its chunk's row
            self.draft.after_plain_step(lanes, chunks, v["input_ids"], ids, decoded)
        # positions have advanced: the sampled id sits at its row's new input position.
        columns = torch.where(v["active"], v["positions"], self.scratch)
        self.history[:lanes].scatter_(1, columns[:, None], v["input_ids"][:, None])
        self.step_ids[:lanes, 0] = v["input_ids"]
        self.counts[:lanes] = rt.rows.active[:lanes]
        self.drafted[:lanes] = 0
        self.lp_n = -1
        self.stop_finished(lanes)

    def sampled(self, ids: np.ndarray) -> None:
        """A step's sampled ids on the host (after its one synchronisation): after a plain step,
        each row that sampled takes its id into the n-gram index."""
        if self._sampled_rows is not None:
            rows, positions = self._sampled_rows
            self._sampled_rows = None
            for row, at in zip(rows.tolist(), positions.tolist()):
                self.ngram.put(row, at, ids[row:row + 1])

    # -- the speculative step ---------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, lanes: int, facts: BatchFacts, features: Features | None) -> bool:
        """Drafts for every active lane's row; False when no row has any (the step then runs
        plain, at a plain step's cost)."""
        rt, k = self.rt, self.k
        rows = rt.rows
        act = np.flatnonzero(rows.active[:lanes])
        pos = rows.positions[act]  # each row's input position
        room = np.clip(self._limits(act) - 1 - pos, 0, k)  # drafts that stay within max_new_tokens
        room[self._undrafted(act)] = 0
        if not room.any():
            return False
        act_t, pos_t, room_t = rt.h2d(np.stack([act, pos, room]).astype(np.int64)).unbind(0)
        if self.draft is not None:  # a draft model fills the room; an EAGLE-3 head skips rows it has not seen
            drafts, drafted = self.draft.propose(act, pos, room, self.history, facts.any_random, facts.any_filter,
                                                 features)
            if not drafted.any():
                return False
            self._proposal = (act, pos, act_t, pos_t, drafts, drafted)
            return True
        host = np.full((len(act), k), -1, np.int64)
        drafted = np.zeros(len(act), np.int64)
        for i in np.flatnonzero(room):  # on the host: nothing waits for the device
            got = self.ngram.propose(int(act[i]), int(room[i]))
            host[i, :len(got)], drafted[i] = got, len(got)
        if not drafted.any():
            return False
        self._proposal = (act, pos, act_t, pos_t, rt.h2d(host), drafted)
        return True

    @torch.inference_mode()
    def verify(self, *, lanes: int, facts: BatchFacts, features: Features | None) -> int:
        """One forward over every active row's input id and drafts (propose's), then acceptance.
        Returns N of the per-row log-probabilities computed (-1: none), as a plain step does."""
        rt, k = self.rt, self.k
        rows, dev = rt.rows, rt.device
        act, pos, act_t, pos_t, drafts, drafted = self._proposal
        self._proposal = None
        q = drafted + 1
        r = len(act)
        # The packed axis: per row, its input id then its drafts, at positions pos .. pos + q - 1.
        within = np.arange(k + 1)[None, :] < q[:, None]
        flat = np.flatnonzero(within.reshape(-1))
        single = np.flatnonzero(drafted == 0) if features is not None else np.zeros(0, np.int64)
        asks, lp = self._logprob_tokens(act, drafted, q, features)
        # Rows without drafts, sampled with the optional stages: their row, packed index and index
        # in `act`; then the tokens whose log-probabilities are computed, and their rows.
        extra = np.concatenate([flat, act[single], (np.cumsum(q) - 1)[single], single, lp.reshape(-1), asks])
        axis = packed_axis(act, pos, q, rt.state["block_table"], rt.cfg.page_size, rt.h2d, extra)
        tok_pos_t, tok_rows_t = axis.positions, axis.rows
        flat_t, single_t, lp_t, asks_t = axis.extra.split([len(flat), 3 * len(single), lp.size, len(asks)])
        single_t, lp_t = single_t.view(3, -1), lp_t.view(3, -1)
        grid = torch.cat([rt.state["input_ids"][act_t][:, None], drafts], 1)
        eagle = self.draft if isinstance(self.draft, Eagle3Head) else None  # it reads the target's hidden states
        hidden = forward(rt.model_cfg, rt.weights, rt.attn, rt.attn.plan(axis.meta), rt.rope, grid.reshape(-1)[flat_t],
                         tok_pos_t, rt.all_reduce, rt.ops, None if eagle is None else eagle.capturing())
        logits = final_logits(rt.weights, hidden, ops=rt.ops)
        st = rt.state
        lp_out = None
        if asks.size:
            n = features.logprobs
            lp_out = (lp_t[0], torch.empty(lp.shape[1], 1 + n, device=dev),
                      torch.empty(lp.shape[1], n, dtype=torch.int64, device=dev))
        sampled = sample_at_positions(logits, st, tok_rows_t, tok_pos_t, facts.any_random, facts.any_filter, features,
                                      lp_out)
        self.lp_n = -1
        if lp_out is not None:
            self._keep_logprobs(lp_t[1], lp_t[2], asks_t, *lp_out[1:])
        target = torch.full((r, k + 1), -1, dtype=torch.int64, device=dev)
        target.view(-1)[flat_t] = sampled
        if single.size:
            target[single_t[2], 0] = self._sample_with_features(lanes, facts, features, logits, single_t,
                                                                 pos_t[single_t[2]])
        # Draft j is accepted while every draft before it was, and it equals the target's token.
        agree = (drafts == target[:, :k]) & (drafts >= 0)
        accepted = agree.to(torch.int64).cumprod(1).sum(1)
        produced = accepted + 1
        st["input_ids"][act_t] = target.gather(1, accepted[:, None]).squeeze(1)
        st["positions"][act_t] += produced
        steps = torch.arange(k + 1, device=dev)[None, :]
        columns = torch.where(steps < produced[:, None], pos_t[:, None] + 1 + steps, self.scratch)
        self.history[act_t[:, None], columns] = target
        self.step_ids[act_t] = target
        # The step's one synchronisation: the next step's lengths need the counts, the n-gram index the tokens.
        host = torch.cat([produced[:, None], target], 1).cpu().numpy()
        made = host[:, 0]
        if self.ngram is not None:
            for i, row in enumerate(act.tolist()):
                self.ngram.put(row, int(pos[i]) + 1, host[i, 1:1 + made[i]])
        self.counts[:lanes] = 0
        self.counts[act] = made
        self.drafted[:lanes] = 0
        self.drafted[act] = drafted
        rows.positions[act] += made
        if eagle is not None:
            eagle.accepted(act, made - 1, pos, q, target)
        elif self.draft is not None:
            self.draft.accepted(act, made - 1)
        rows.changed()  # positions moved by more than one: facts and slots are recomputed
        self.stop_finished(lanes)
        return -1 if features is None else features.logprobs

    def _logprob_tokens(self, act: np.ndarray, drafted: np.ndarray, q: np.ndarray,
                        features: Features | None) -> tuple[np.ndarray, np.ndarray]:
        """The drafted rows of `act` that ask for log-probabilities (rows without drafts get
        theirs with their other stages), and [3, T] for each of their tokens: its packed index,
        its row and its index in the row's step (0 .. q - 1)."""
        if features is None or features.logprobs < 0:
            return np.zeros(0, np.int64), np.zeros((3, 0), np.int64)
        asks = np.flatnonzero((self.rt.rows.host["logprobs"][act] >= 0) & (drafted > 0))
        n = q[asks]
        cols = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        return act[asks], np.stack([np.repeat((np.cumsum(q) - q)[asks], n) + cols, np.repeat(act[asks], n), cols])

    def _keep_logprobs(self, rows: torch.Tensor, cols: torch.Tensor, asks: torch.Tensor, values: torch.Tensor,
                       ids: torch.Tensor) -> None:
        """Tokens' log-probabilities (of rows `rows`, at step indices `cols`) into lp_values /
        lp_ids, each row's first also where a plain step leaves it, for the ring's per-row entry."""
        n = ids.shape[1]
        self.lp_values[rows, cols, :1 + n] = values
        self.lp_ids[rows, cols, :n] = ids
        st = self.rt.state
        st["lp_values"][asks, :1 + n] = self.lp_values[asks, 0, :1 + n]
        st["lp_ids"][asks, :n] = self.lp_ids[asks, 0, :n]
        self.lp_n = n

    def _sample_with_features(self, lanes: int, facts: BatchFacts, features: Features, logits: torch.Tensor,
                              single: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The undrafted rows' tokens (`single`: rows, packed indices), sampled with the batch's
        optional stages as a plain step samples them; their penalty counts and log-probabilities
        are updated in place (a grammar's matcher takes the ids after the step, from the ring)."""
        rt = self.rt
        st, v = rt.state, rt.lane_views[lanes]
        row_t, at_t = single[0], single[1]
        if features.grammar:
            rt.grammar_masks(v, lanes)
        lp_values = lp_ids = None
        if features.logprobs >= 0:
            lp_values, lp_ids = st["lp_values"][row_t], st["lp_ids"][row_t]
        ids = sample_with_features(logits[at_t], RowParams.of_state(st).select(row_t), positions, st["vocab_keys"],
                                   facts.any_random, facts.any_filter, features, lp_values, lp_ids)
        if lp_values is not None:
            st["lp_values"][row_t], st["lp_ids"][row_t] = lp_values, lp_ids
        if features.penalties:  # the sampled ids join their rows' outputs
            st["output_counts"].index_put_((row_t, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        return ids

    def admitted(self, admits: list) -> None:
        """Rows taken by new sequences: their histories start with the ids their chunks skip
        (a prefix-cache hit) and fill from their chunks."""
        for a in admits:
            if self.ngram is not None:
                self.ngram.reset(a.row)
                self.ngram.put(a.row, 0, a.cached_ids)
            if len(a.cached_ids):
                n = min(len(a.cached_ids), self.scratch)
                self.history[a.row, :n] = torch.from_numpy(np.asarray(a.cached_ids[:n], np.int64)).to(self.rt.device)
        if self.draft is not None:
            self.draft.admitted([a.row for a in admits], [len(a.cached_ids) for a in admits])

    def write_outputs(self, lanes: int, outputs: "StepOutputs") -> None:
        """The last step's per-row counts and tokens into the ring slot's views."""
        outputs.spec_counts[:lanes, 0] = torch.from_numpy(self.counts[:lanes])
        outputs.spec_counts[:lanes, 1] = torch.from_numpy(self.drafted[:lanes])
        outputs.spec_ids[:lanes].copy_(self.step_ids[:lanes])
        n = self.lp_n
        if n >= 0:  # tokens 1..k's log-probabilities (token 0's go with a plain step's)
            outputs.spec_logprobs[:lanes, :, :1 + n].copy_(self.lp_values[:lanes, 1:, :1 + n])
            outputs.spec_logprob_ids[:lanes, :, :n].copy_(self.lp_ids[:lanes, 1:, :n])

    # -- internals --------------------------------------------------------------------------------
    def _limits(self, rows: np.ndarray) -> np.ndarray:
        """Each row's last input position + 1: prompt_len + max_new_tokens - 1 (unbounded: max_seq_len)."""
        host = self.rt.rows.host
        most = host["max_new_tokens"][rows]
        return np.where(most > 0, host["prompt_lens"][rows] + most - 1, self.rt.cfg.max_seq_len)

    def stop_finished(self, lanes: int) -> None:
        """Rows that produced their max_new_tokens stop being active: the parent may still send
        steps for them (it schedules ahead of acceptance), which must not move them further."""
        rows = self.rt.rows
        act = np.flatnonzero(rows.active[:lanes])
        done = act[rows.positions[act] >= self._limits(act)]
        if done.size:
            self.rt.state["active"][self.rt.h2d(done.astype(np.int64))] = False
            rows.active[done] = False
            rows.changed()
