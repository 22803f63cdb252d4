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
class Request:
    request_id: int
    prompt: str | None
    prompt_ids: np.ndarray  # int32
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    arrival: float = field(default_factory=time.perf_counter)
    row: int = -1
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages reserved and not yet taken
    scheduled: int = 0  # generated tokens the sent commands will produce
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @cached_property
    def seed_key(self) -> int:
        return seed_key(self.seed)

    def pages_needed(self, page_size: int) -> int:
        # The last generated token is never fed back, so the cache holds prompt + max_new - 1.
        return math.ceil((self.prompt_len + self.params.max_new_tokens - 1) / page_size)


@dataclass
class Scheduled:
    """A command ready to send, with what the parent must do around it."""

    command: Command
    producers: list[tuple[int, Request]]  # (row, request) whose token this step samples
    staging_tokens: list[tuple[int, np.ndarray]]  # (offset, ids) to write into the step's staging slot


class Scheduler:
    def __init__(self, *, max_batch_size: int, page_size: int, max_blocks_per_row: int, num_pages: int,
                 prefill_capacity: int, full_state: bool):
        self.page_size = page_size
        self.max_blocks = max_blocks_per_row
        self.prefill_capacity = prefill_capacity
        self.full_state = full_state  # copy_policy="always"
        self.pages = PageAllocator(num_pages)
        self.rows: list[Request | None] = [None] * max_batch_size
        self.waiting: deque[Request] = deque()
        self.pending_finish: list[int] = []
        self.step = 0

    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def next_command(self) -> Scheduled | None:
        """A prefill when requests wait and rows and pages allow, else a decode step, else None."""
        sched = self._admit() or self._decode()
        if sched is not None:
            self.step += 1
        return sched

    def on_tokens(self, producers: list[tuple[int, Request]], ids: np.ndarray, now: float) -> list[Request]:
        """Records a step's sampled ids; returns the requests that finished with it."""
        done = []
        for row, req in producers:
            if req.finished:
                continue  # computed past its stop by run-ahead: dropped
            token = int(ids[row])
            req.tokens.append(token)
            req.last_token_at = now
            if len(req.tokens) == 1:
                req.first_token_at = now
            if token in req.stop_ids:
                req.finish_reason = "stop"
                self._release(req)
            elif len(req.tokens) == req.params.max_new_tokens:
                req.finish_reason = "length"
            if req.finished:
                done.append(req)
        return done

    @property
    def idle(self) -> bool:
        return not self.waiting and all(r is None for r in self.rows)

    # -- internals -------------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Frees the row and pages now; the child deactivates the row at the start of the next
        command, before anything it computes, and commands run in order, so reuse is safe."""
        if req.row < 0 or self.rows[req.row] is not req:
            return
        self.rows[req.row] = None
        self.pending_finish.append(req.row)
        self.pages.release(req.pages, req.reserved)
        req.pages, req.reserved = [], 0

    def _take_finished(self) -> list[int]:
        rows, self.pending_finish = self.pending_finish, []
        return rows

    def _admit(self) -> Scheduled | None:
        admits, producers, staging = [], [], []
        used = 0
        free_rows = [i for i, r in enumerate(self.rows) if r is None]
        while self.waiting and free_rows:
            req = self.waiting[0]
            if used + req.prompt_len > self.prefill_capacity:
                break
            if not self.pages.reserve(req.pages_needed(self.page_size)):
                break  # head-of-line waits for pages: keeps arrival order
            self.waiting.popleft()
            req.row = free_rows.pop(0)
            req.reserved = req.pages_needed(self.page_size)
            for _ in range(math.ceil(req.prompt_len / self.page_size)):
                self._take(req)
            req.admitted_at = time.perf_counter()
            req.scheduled = 1
            self.rows[req.row] = req
            p = req.params
            admits.append(Admit(req.row, req.prompt_len, used, np.array(req.pages, np.int32), float(p.temperature),
                                float(p.top_p), int(p.top_k), int(req.seed)))
            producers.append((req.row, req))
            staging.append((used, req.prompt_ids))
            used += req.prompt_len
        if not admits:
            return None
        cmd = Command(step=self.step, finished_rows=self._take_finished(), admits=admits)
        for _, req in producers:
            self._release_if_fully_scheduled(req)
        return Scheduled(cmd, producers, staging)

    def _take(self, req: Request) -> int:
        """Moves one page from the request's reservation into its block list."""
        req.reserved -= 1
        page = self.pages.take()
        req.pages.append(page)
        return page

    def _release_if_fully_scheduled(self, req: Request) -> None:
        if req.scheduled == req.params.max_new_tokens:
            self._release(req)

    def _decode(self) -> Scheduled | None:
        producers = [(i, r) for i, r in enumerate(self.rows) if r is not None and not r.finished]
        if not producers:
            return None
        triples = []
        for row, req in producers:
            pos = req.prompt_len + req.scheduled - 1  # position of this step's input token
            if pos % self.page_size == 0:
                triples.append((row, pos // self.page_size, self._take(req)))
        cmd = Command(step=self.step, finished_rows=self._take_finished(),
                      new_pages=np.array(triples, np.int32).reshape(-1, 3))
        if self.full_state:
            cmd.full_state = self._full_state(producers)
        for _, req in producers:
            req.scheduled += 1
            self._release_if_fully_scheduled(req)
        return Scheduled(cmd, producers, [])

    def _full_state(self, producers: list[tuple[int, Request]]) -> FullState:
        """copy_policy="always": rebuild every decode input from scratch, as older systems did."""
        b, page = len(self.rows), self.page_size
        st = FullState(
            positions=np.zeros(b, np.int64), active=np.zeros(b, bool),
            block_table=np.zeros((b, self.max_blocks), np.int32), slot_mapping=np.zeros(b, np.int64),
            temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int64),
            seed_keys=np.zeros(b, np.int64),
        )
        for row, req in producers:
            pos = req.prompt_len + req.scheduled - 1
            st.positions[row] = pos
            st.active[row] = True
            st.block_table[row, :len(req.pages)] = req.pages
            st.slot_mapping[row] = req.pages[pos // page] * page + pos % page
            st.temperature[row] = float(req.params.temperature)
            st.top_p[row] = float(req.params.top_p)
            st.top_k[row] = int(req.params.top_k)
            st.seed_keys[row] = req.seed_key
        return st
