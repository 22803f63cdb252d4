"""Which request sits in which batch row, and the diff-only command for each step.

Pure bookkeeping, no IO. The scheduler knows every row's position at every future step, so with
several commands in flight it still sends each page triple before the step that needs it.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from chip_child.protocol import Admit, Command, FullState
from chip_child.sampling import seed_key
from l3worker.pages import PageAllocator
from l3worker.params import SamplingParams


@dataclass
class Sequence:
    """One sample of a request: it occupies one batch row while it runs."""

    seq_id: int
    index: int  # which of the request's n samples
    prompt_ids: np.ndarray  # int32
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    arrival: float = field(default_factory=time.perf_counter)
    want_prompt_logprobs: bool = False  # sample 0 of a request that asked for them
    request_id: str = ""
    row: int = -1
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages reserved and not yet taken
    scheduled: int = 0  # tokens the sent commands will sample (the prefill's counts, even when dropped)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    prev_token_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def steps_needed(self) -> int:
        """Tokens to sample: a scoring request (max_new_tokens 0) still runs its prefill."""
        return max(self.params.max_new_tokens, 1)

    @cached_property
    def seed_key(self) -> int:
        return seed_key(self.seed)

    def pages_needed(self, page_size: int) -> int:
        # The last sampled token is never fed back, so the cache holds prompt + steps - 1.
        return math.ceil((self.prompt_len + self.steps_needed - 1) / page_size)


@dataclass
class Scheduled:
    """A command ready to send, with what the parent must do around it."""

    command: Command
    producers: list[tuple[int, Sequence]]  # (row, sequence) whose token this step samples
    staging_tokens: list[tuple[int, np.ndarray]]  # (offset, ids) to write into the step's staging slot
    prompt_logprobs: list[tuple[int, Sequence]] = field(default_factory=list)  # (staging offset, sequence)


class Scheduler:
    def __init__(self, *, max_batch_size: int, page_size: int, max_blocks_per_row: int, num_pages: int,
                 prefill_capacity: int, full_state: bool):
        self.page_size = page_size
        self.max_blocks = max_blocks_per_row
        self.prefill_capacity = prefill_capacity
        self.full_state = full_state  # copy_policy="always"
        self.pages = PageAllocator(num_pages)
        self.rows: list[Sequence | None] = [None] * max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.pending_finish: list[int] = []
        self.step = 0

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def next_command(self) -> Scheduled | None:
        """A prefill when sequences wait and rows and pages allow, else a decode step, else None."""
        sched = self._admit() or self._decode()
        if sched is not None:
            self.step += 1
        return sched

    def on_tokens(self, producers: list[tuple[int, Sequence]], ids: np.ndarray,
                  now: float) -> list[tuple[int, Sequence]]:
        """Records a step's sampled ids; returns the (row, sequence) pairs that advanced, finished
        ones included.
        A sequence finished earlier (a stop, an abort) gets nothing: its run-ahead tokens are dropped."""
        advanced = []
        for row, seq in producers:
            if seq.finished:
                continue
            if seq.params.max_new_tokens == 0:  # scoring only: the prefill's token is not an output
                self.finish(seq, "length")
                advanced.append((row, seq))
                continue
            token = int(ids[row])
            seq.tokens.append(token)
            seq.prev_token_at, seq.last_token_at = seq.last_token_at, now
            if len(seq.tokens) == 1:
                seq.first_token_at = now
            if token in seq.stop_ids and len(seq.tokens) > seq.params.min_tokens:
                self.finish(seq, "stop", token)
            elif len(seq.tokens) == seq.params.max_new_tokens:
                self.finish(seq, "length")
            advanced.append((row, seq))
        return advanced

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends a sequence (stop, length or abort) and frees its row and pages; waiting ones leave
        the queue. Finishing a finished sequence does nothing."""
        if seq.finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.row < 0:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and all(r is None for r in self.rows)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.rows)

    # -- internals -------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """Frees the row and pages now; the child deactivates the row at the start of the next
        command, before anything it computes, and commands run in order, so reuse is safe."""
        if seq.row < 0 or self.rows[seq.row] is not seq:
            return
        self.rows[seq.row] = None
        self.pending_finish.append(seq.row)
        self.pages.release(seq.pages, seq.reserved)
        seq.pages, seq.reserved = [], 0

    def _take_finished(self) -> list[int]:
        rows, self.pending_finish = self.pending_finish, []
        return rows

    def _admit(self) -> Scheduled | None:
        admits, producers, staging, scoring = [], [], [], []
        used = 0
        free_rows = [i for i, r in enumerate(self.rows) if r is None]
        while self.waiting and free_rows:
            seq = self.waiting[0]
            if used + seq.prompt_len > self.prefill_capacity:
                break
            if not self.pages.reserve(seq.pages_needed(self.page_size)):
                break  # head-of-line waits for pages: keeps arrival order
            self.waiting.popleft()
            seq.row = free_rows.pop(0)
            seq.reserved = seq.pages_needed(self.page_size)
            for _ in range(math.ceil(seq.prompt_len / self.page_size)):
                self._take(seq)
            seq.admitted_at = time.perf_counter()
            seq.scheduled = 1
            self.rows[seq.row] = seq
            admits.append(_admit_command(seq, used))
            producers.append((seq.row, seq))
            staging.append((used, seq.prompt_ids))
            if seq.want_prompt_logprobs:
                scoring.append((used, seq))
            used += seq.prompt_len
        if not admits:
            return None
        cmd = Command(step=self.step, finished_rows=self._take_finished(), admits=admits)
        for _, seq in producers:
            self._release_if_fully_scheduled(seq)
        return Scheduled(cmd, producers, staging, scoring)

    def _take(self, seq: Sequence) -> int:
        """Moves one page from the sequence's reservation into its block list."""
        seq.reserved -= 1
        page = self.pages.take()
        seq.pages.append(page)
        return page

    def _release_if_fully_scheduled(self, seq: Sequence) -> None:
        if seq.scheduled == seq.steps_needed:
            self._release(seq)

    def _decode(self) -> Scheduled | None:
        producers = [(i, r) for i, r in enumerate(self.rows) if r is not None and not r.finished]
        if not producers:
            return None
        triples = []
        for row, seq in producers:
            pos = seq.prompt_len + seq.scheduled - 1  # position of this step's input token
            if pos % self.page_size == 0:
                triples.append((row, pos // self.page_size, self._take(seq)))
        cmd = Command(step=self.step, finished_rows=self._take_finished(),
                      new_pages=np.array(triples, np.int32).reshape(-1, 3))
        if self.full_state:
            cmd.full_state = self._full_state(producers)
        for _, seq in producers:
            seq.scheduled += 1
            self._release_if_fully_scheduled(seq)
        return Scheduled(cmd, producers, [])

    def _full_state(self, producers: list[tuple[int, Sequence]]) -> FullState:
        """copy_policy="always": rebuild every decode input from scratch, as older systems did."""
        b, page = len(self.rows), self.page_size
        st = FullState(
            positions=np.zeros(b, np.int64), active=np.zeros(b, bool),
            block_table=np.zeros((b, self.max_blocks), np.int32), slot_mapping=np.zeros(b, np.int64),
            temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int64),
            seed_keys=np.zeros(b, np.int64),
        )
        for row, seq in producers:
            pos = seq.prompt_len + seq.scheduled - 1
            st.positions[row] = pos
            st.active[row] = True
            st.block_table[row, :len(seq.pages)] = seq.pages
            st.slot_mapping[row] = seq.pages[pos // page] * page + pos % page
            st.temperature[row] = float(seq.params.temperature)
            st.top_p[row] = float(seq.params.top_p)
            st.top_k[row] = int(seq.params.top_k)
            st.seed_keys[row] = seq.seed_key
        return st


def _admit_command(seq: Sequence, staging_offset: int) -> Admit:
    p = seq.params
    return Admit(seq.row, seq.prompt_len, staging_offset, np.array(seq.pages, np.int32), float(p.temperature),
                 float(p.top_p), int(p.top_k), int(seq.seed), min_p=float(p.min_p),
                 presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
                 repetition_penalty=float(p.repetition_penalty), min_tokens=int(p.min_tokens),
                 stop_ids=np.array(sorted(seq.stop_ids), np.int32),
                 logprobs=-1 if p.logprobs is None else int(p.logprobs),
                 prompt_logprobs=int(p.prompt_logprobs) if seq.want_prompt_logprobs else -1)
