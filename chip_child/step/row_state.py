"""The rows of a batch: their pooled device tensors and the host copies read instead of the device.

A row is set up when a sequence takes it (its Admit), starts decoding when its prompt's last
chunk runs, and is finished when the sequence leaves; under copy_policy="always" every row is
overwritten from a FullState each step. The per-row fields (chip_child.step.row_fields) go to the
device and the host copies as the table says. Beside them, RowState derives what the sampler's
optional stages need (the stop-id mask and the position until which min_tokens applies it, the
penalty counts' reset, which rows are held to a grammar) and the batch's facts, kept between admissions instead of recomputed on
every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from chip_child.sampling.grammar import bitmask_words
from chip_child.step.graphs import bucket_of
from chip_child.step.row_fields import DEVICE_FIELDS, FULL_STATE_FIELDS, SCALAR_FIELDS, Admit, FullState, uses_penalties
from chip_child.sampling.sampler import Features

_NO_STOPS = np.zeros(0, np.int64)


@dataclass
class BatchFacts:
    """What the host knows of the batch between admissions: kept, not recomputed each step."""

    furthest: int  # the longest active row's position (this step's input position)
    any_random: bool
    any_filter: bool
    any_active: bool
    any_penalty: bool = False
    any_min_p: bool = False  # a random row with min_p > 0
    mask_steps: int = 0  # decode steps, this one first, in which some row still masks its stop ids
    logprobs: int = -1  # the largest N an active row asked for; -1: none
    any_grammar: bool = False  # an active row is held to a grammar (chip_child.sampling.grammar)
    plain: bool = True  # none of the five above: the plain sampler alone
    lanes: int = 1  # the lane bucket holding every active row

    def update_plain(self) -> None:
        self.plain = not (self.any_penalty or self.any_min_p or self.mask_steps > 0 or self.logprobs >= 0
                          or self.any_grammar)

    def features(self, want_logprobs: bool) -> Features | None:
        """This step's optional sampler stages; None when it runs the plain sampler."""
        mask = self.mask_steps > 0
        if mask:
            self.mask_steps -= 1
            if not self.mask_steps:
                self.update_plain()
        logprobs = self.logprobs if want_logprobs else -1
        if not (self.any_penalty or self.any_min_p or mask or logprobs >= 0 or self.any_grammar):
            return None
        return Features(self.any_penalty, self.any_min_p, mask, logprobs, self.any_grammar)


def row_slots(batch: int, vocab: int, max_blocks: int) -> tuple[tuple[str, tuple, torch.dtype, str], ...]:
    """(slot, shape, dtype, role) of the pooled tensors RowState owns."""
    b, i32, i64, f32 = batch, torch.int32, torch.int64, torch.float32
    return (
        ("positions", (b,), i64, "inout"),
        ("active", (b,), torch.bool, "inout"),
        ("block_table", (b, max_blocks), i32, "in"),
        ("slot_mapping", (b,), i64, "inout"),
        *((f.array, (b,), torch.from_numpy(np.zeros(0, f.dtype)).dtype, "in") for f in DEVICE_FIELDS),
        ("min_pos", (b,), i64, "in"),  # stop ids are masked while a row's input position is below it
        ("output_counts", (b, vocab), f32, "inout"),
        ("prompt_seen", (b, vocab), f32, "inout"),  # 1.0 / 0.0: float arithmetic is faster than bool
        ("stop_mask", (b, vocab), torch.bool, "in"),
        ("grammar_mask", (b, bitmask_words(vocab)), i32, "in"),  # all bits set: any token
    )


def _min_pos(prompt_lens: np.ndarray, min_tokens: np.ndarray, has_stops: np.ndarray) -> np.ndarray:
    return np.where(has_stops & (min_tokens > 0), prompt_lens - 1 + min_tokens, 0).astype(np.int64)


class RowState:
    """`state` holds the tensors of row_slots() (and may hold more); every host-to-device copy
    goes through `h2d`, so the caller can count them; `buckets[k]` is the lane bucket of a batch
    whose highest active row is k - 1 (chip_child.step.graphs.bucket_of)."""

    def __init__(self, state: dict[str, torch.Tensor], h2d: Callable[[np.ndarray], torch.Tensor],
                 buckets: list[int]):
        self.state = state
        self._h2d = h2d
        self._buckets = buckets
        b = state["positions"].shape[0]
        self.vocab_size = state["stop_mask"].shape[1]
        self.positions = np.zeros(b, np.int64)  # each row's input position of the next step
        self.active = np.zeros(b, bool)
        self.host = {f.array: np.full(b, f.neutral, f.dtype) for f in SCALAR_FIELDS}  # the fields' host copies
        for f in DEVICE_FIELDS:  # every row starts idle, with neutral values here as on the host
            state[f.array].fill_(f.neutral)
        state["grammar_mask"].fill_(-1)
        self.penalized = np.zeros(b, bool)
        self.constrained = np.zeros(b, bool)  # held to a grammar: its matcher is the runtime's (RowGrammars)
        self.min_pos = np.zeros(b, np.int64)
        self._facts: BatchFacts | None = None
        self.slot_steps = 0  # decode steps whose slots are the previous step's plus one

    @classmethod
    def allocate(cls, batch: int, vocab: int, max_blocks: int, device: str = "cpu") -> "RowState":
        """A RowState on tensors of its own (the runtime passes its pooled ones instead)."""
        state = {slot: torch.zeros(shape, dtype=dtype, device=device)
                 for slot, shape, dtype, _ in row_slots(batch, vocab, max_blocks)}
        return cls(state, lambda arr: torch.from_numpy(np.ascontiguousarray(arr)).to(device), bucket_of(batch).tolist())

    def changed(self) -> None:
        """Rows were admitted, finished or overwritten: the batch's facts are recomputed before
        the next step instead of on every step."""
        self._facts = None
        self.slot_steps = 0

    def facts(self) -> BatchFacts:
        if self._facts is None:
            act, host = self.active, self.host
            live = self.positions[act]
            random = host["temperature"][act] > 0
            filtered = (host["top_k"][act] > 0) | (host["top_p"][act] < 1)
            facts = BatchFacts(int(live.max()) if live.size else 0, bool(random.any()), bool(filtered.any()),
                               bool(live.size))
            facts.lanes = self._buckets[int(np.flatnonzero(act)[-1]) + 1 if live.size else 0]
            if live.size:
                facts.any_penalty = bool(self.penalized[act].any())
                facts.any_min_p = bool((random & (host["min_p"][act] > 0)).any())
                facts.mask_steps = max(0, int((self.min_pos[act] - live).max()))
                facts.logprobs = int(host["logprobs"][act].max())
                facts.any_grammar = bool(self.constrained[act].any())
            facts.update_plain()
            self._facts = facts
        return self._facts

    def advance(self) -> None:
        """A step ran: every active row's input position moves on by one."""
        self.positions += self.active
        if self._facts is not None:
            self._facts.furthest += self._facts.any_active

    def start_decoding(self, rows: list[int], positions: list[int]) -> None:
        """Rows whose prompt ends in this step: they decode from its sample on, which counts
        from `positions` (the prompts' last)."""
        self.active[rows] = True
        self.positions[rows] = positions
        self.changed()

    def finish(self, rows: list[int]) -> None:
        idx = self._h2d(np.asarray(rows, np.int64))
        self.state["active"][idx] = False
        self.state["positions"][idx] = 0
        self.active[rows] = False
        self.positions[rows] = 0
        self.constrained[rows] = False
        self.changed()

    def set_up(self, admits: list[Admit]) -> None:
        """Rows taken by new sequences: their fields and derived state; not active until their
        last chunk ran, and with an empty block table until triples fill it."""
        rows = np.array([a.row for a in admits], np.int64)
        values = {f.array: np.array([f.to_array(getattr(a, f.name)) for a in admits], f.dtype) for f in SCALAR_FIELDS}
        # Stop ids are masked while the input position is below min_pos: never for a row without them.
        stops = [np.asarray(a.stop_ids, np.int64) if a.min_tokens > 0 else _NO_STOPS for a in admits]
        min_pos = _min_pos(values["prompt_lens"], values["min_tokens"], np.array([s.size > 0 for s in stops]))
        penalized = uses_penalties(values["presence_penalty"], values["frequency_penalty"],
                                   values["repetition_penalty"])
        idx = self._h2d(rows)
        st = self.state
        st["active"][idx] = False
        st["positions"][idx] = 0
        st["block_table"][idx] = 0
        self._scatter(idx, {**{f.array: values[f.array] for f in DEVICE_FIELDS}, "min_pos": min_pos})
        for row in rows[penalized].tolist():  # counted from the row's chunks as they run
            st["output_counts"][row].zero_()
            st["prompt_seen"][row].zero_()
        if min_pos.any():
            for row in rows[min_pos > 0].tolist():
                st["stop_mask"][row].zero_()
            self._mask_stops(np.concatenate([np.full(s.size, a.row, np.int64) for a, s in zip(admits, stops)]),
                             np.concatenate(stops))
        for name, column in values.items():
            self.host[name][rows] = column
        self.active[rows] = False
        self.positions[rows] = 0
        self.penalized[rows] = penalized
        self.constrained[rows] = [len(a.grammar) > 0 for a in admits]
        self.min_pos[rows] = min_pos
        self.changed()

    def load_full_state(self, fs: FullState) -> None:
        """copy_policy="always": overwrite every decode input from the host, as older systems did,
        the per-row fields included (the output token counts are device state, kept; so are the
        positions and slots when the state leaves them out, as it does under speculation)."""
        st = self.state
        given = ("positions", "slot_mapping") if fs.positions is not None else ()
        for name in (*given, "active", "block_table", *(f.array for f in DEVICE_FIELDS)):
            st[name].copy_(self._h2d(getattr(fs, name)))
        has_stops = (fs.stop_ids >= 0).any(axis=1)
        min_pos = _min_pos(fs.prompt_lens, fs.min_tokens, has_stops)
        st["min_pos"].copy_(self._h2d(min_pos))
        st["stop_mask"].zero_()
        rows, cols = np.nonzero(fs.stop_ids >= 0)
        if rows.size:
            self._mask_stops(rows.astype(np.int64), fs.stop_ids[rows, cols])
        if fs.positions is not None:
            self.positions[:] = fs.positions
        self.active[:] = fs.active
        for f in FULL_STATE_FIELDS:
            if f.kind != "ids":
                self.host[f.array][:] = getattr(fs, f.array)
        self.penalized[:] = uses_penalties(fs.presence_penalty, fs.frequency_penalty, fs.repetition_penalty)
        self.min_pos[:] = min_pos
        self.changed()

    def reset(self) -> None:
        """With no row active: every row's tables zeroed, as warm-up leaves them."""
        for name in ("block_table", "output_counts", "prompt_seen", "stop_mask"):
            self.state[name].zero_()
        self.state["grammar_mask"].fill_(-1)

    def _scatter(self, idx: torch.Tensor, columns: dict[str, np.ndarray]) -> None:
        """Each column into its rows of the device tensor of its name: one copy per dtype."""
        for dtype in dict.fromkeys(c.dtype for c in columns.values()):
            names = [name for name, c in columns.items() if c.dtype == dtype]
            dev = self._h2d(np.stack([columns[name] for name in names], axis=1))
            for j, name in enumerate(names):
                self.state[name][idx] = dev[:, j]

    def _mask_stops(self, rows: np.ndarray, ids: np.ndarray) -> None:
        self.state["stop_mask"].view(-1)[self._h2d(rows * self.vocab_size + ids)] = True

    def token_adapters(self, chunks: list, lanes: int) -> np.ndarray:
        """Each packed token's adapter slot (-1: none): the forward's `lanes` lanes', then every
        chunk's tokens'."""
        host = self.host["lora_slot"]
        lane_slots = np.where(self.active[:lanes], host[:lanes], -1)
        return np.concatenate([lane_slots, np.repeat(host[[c.row for c in chunks]], [c.length for c in chunks])])
