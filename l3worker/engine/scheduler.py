"""Which sequence sits in which batch row, and the diff-only command for each step.

Pure bookkeeping, no IO. A step is a token budget (`max_num_batched_tokens`): every decoding row
takes one token, and prefill chunks share the rest, so a long prompt is prefilled over several
steps while the other rows keep producing tokens. Pages are taken from the pool as rows grow;
full pages are committed to the prefix cache, so a later prompt that starts the same way
prefills only the rest. When the pool runs dry the most recently admitted sequence is
preempted: its pages go back, and it later resumes by prefilling its prompt plus the tokens it
already produced (mostly prefix-cache hits), which gives the same tokens as an unpreempted run.

The scheduler knows every row's position at every future step, so with several commands in
flight it still sends each page triple before the step that needs it. A sequence finished or
preempted while commands are in flight gets nothing from them: `epoch` tells stale tokens apart.

With speculative decoding (k drafts a row per step, verified in the child) a decode step moves a
row on by 1 to k + 1 positions, which the parent learns only when it reads the step. `fed` is
then an upper bound (each step in flight counts k + 1, tightened as steps are read), pages are
provided up to it, and a row leaves once its steps in flight surely produced its max_new_tokens.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from chip_child.protocol import Admit, Chunk, Command, FullState
from l3worker.engine.page_pool import ROOT_HASH, CacheCursor, PagePool, PrefixHit
from l3worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from l3worker.lora.registry import LoraRegistry


@dataclass
class Scheduled:
    """A command ready to send, with what the parent must do around it."""

    command: Command
    producers: list[tuple[int, Sequence, int]]  # (row, sequence, epoch) whose token this step samples
    staging_tokens: list[tuple[int, np.ndarray]]  # (offset, ids) to write into the step's staging slot
    # (staging offset, first position, length, sequence) of chunks whose prompt logprobs are wanted
    prompt_logprobs: list[tuple[int, int, int, Sequence]] = field(default_factory=list)


class Scheduler:
    def __init__(self, *, max_batch_size: int, page_size: int, max_blocks_per_row: int, num_pages: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool, full_state: bool,
                 speculative_tokens: int = 0, priority: bool = False, host_pages: int = 0,
                 loras: LoraRegistry | None = None):
        self.page_size = page_size
        self.max_blocks = max_blocks_per_row
        self.budget = max_num_batched_tokens
        # Prompt tokens a step with decoding rows may carry (set from step times by the step loop,
        # l3worker/engine/step_timing.py); None: the token budget alone.
        self.prefill_cap: int | None = None
        self.full_state = full_state  # copy_policy="always"
        self.k = speculative_tokens  # drafts a row verifies per step at most (0: no speculation)
        # scheduling_policy="priority": waiting kept in (priority, arrival) order, and a waiting
        # sequence that outranks a running one takes its row and pages (vLLM's priority policy).
        self.priority = priority
        self.loras = loras
        self.lora_loads: list[tuple[int, str]] = []  # (slot, adapter file) to send before the next command
        self._pool_args = (num_pages, page_size, enable_prefix_caching, host_pages)
        self.pages = self._new_pool()
        self.max_batch_size = max_batch_size
        self.running: dict[int, Sequence] = {}  # row -> its sequence, occupied rows only: scans cost what runs
        self.waiting: deque[Sequence] = deque()
        self.pending_finish: list[int] = []
        self.step = 0
        self.num_preemptions = 0
        self._admissions = itertools.count()

    def add(self, seqs: list[Sequence]) -> None:
        if not self.priority:
            self.waiting.extend(seqs)
            return
        for seq in seqs:
            self._wait_in_rank(seq)

    def next_command(self) -> Scheduled | None:
        """The next step's command, or None when no row has anything to compute."""
        if self.priority:
            self._make_room_for_better()
        self._grow_decoding_rows()
        triples: list[tuple[int, int, int]] = []
        chunks, staging, scoring = [], [], []
        used = self._decoding_tokens()
        limit = self.budget if self._whole_budget(used) else min(self.budget, used + self.prefill_cap)
        for seq in self._prefilling_rows():  # continue prompts already under way, oldest first
            used += self._schedule_chunk(seq, limit - used, chunks, staging, scoring, triples)
        admits = self._admit(used, limit, chunks, staging, scoring, triples)
        producers = [(c.row, self.running[c.row], self.running[c.row].epoch) for c in chunks if c.last]
        chunk_rows = {c.row for c in chunks}
        k, page = self.k, self.page_size
        decoding = False
        for row in sorted(self.running):  # in row order
            seq = self.running[row]
            if seq.prefilling or row in chunk_rows:
                continue
            fed = seq.fed
            if k:  # every page up to its bound, each sent once
                triples.extend((row, block, seq.pages[block]) for block in range(seq.blocks_sent, len(seq.pages)))
                seq.blocks_sent = len(seq.pages)
                seq.fed = min(fed + k + 1, seq.kv_end)
            else:
                if fed % page == 0:  # this step's input starts a new page
                    triples.append((row, fed // page, seq.pages[fed // page]))
                seq.fed = fed + 1
            seq.scheduled += 1
            producers.append((row, seq, seq.epoch))
            decoding = True
        if not chunks and not decoding:
            return None  # finished rows, if any, go out with the next command
        cmd = Command(step=self.step, finished_rows=self._take_finished(),
                      new_pages=np.array(triples, np.int32).reshape(-1, 3), admits=admits, chunks=chunks)
        if self.full_state and not chunks:
            cmd.full_state = self._full_state([(r, s) for r, s, _ in producers])
        self.step += 1
        for _, seq, _ in producers:
            seq.inflight += 1
            self._commit(seq)
            if seq.scheduled >= seq.steps_needed:
                self._release(seq)  # nothing more to compute: row and pages free for the next command
        return Scheduled(cmd, producers, staging, scoring)

    def on_tokens(self, producers: list[tuple[int, Sequence, int]], ids: np.ndarray,
                  now: float) -> list[tuple[int, Sequence]]:
        """Records a step's sampled ids; returns the (row, sequence) pairs that advanced, finished
        ones included. A sequence finished or preempted since the command was sent gets nothing."""
        advanced = []
        row_ids = ids.tolist()  # Python ints, read once: this loop runs for every token
        for row, seq, epoch in producers:
            if seq.finish_reason is not None or epoch != seq.epoch:
                continue
            params = seq.params
            if params.max_new_tokens == 0:  # scoring only: the prefill's token is not an output
                self.finish(seq, "length")
                advanced.append((row, seq))
                continue
            token, tokens = row_ids[row], seq.tokens
            seq.ids[seq.prompt_len + len(tokens)] = token
            tokens.append(token)
            seq.prev_token_at, seq.last_token_at = seq.last_token_at, now
            produced = len(tokens)
            if produced == 1:
                seq.first_token_at = now
            self._commit(seq)
            if token in seq.stop_ids and produced > params.min_tokens:
                self.finish(seq, "stop", token)
            elif produced == params.max_new_tokens:
                self.finish(seq, "length")
            advanced.append((row, seq))
        return advanced

    def settle(self, producers: list[tuple[int, Sequence, int]]) -> None:
        """Speculating: a step's tokens were all read (on_tokens, once per token position); each
        live sequence's bound on its fed positions tightens to what its steps in flight can add."""
        for _, seq, epoch in producers:
            if seq.finished or epoch != seq.epoch:
                continue
            seq.inflight -= 1
            seq.fed = min(seq.fed, seq.known - 1 + (self.k + 1) * seq.inflight)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends a sequence (stop, length or abort) and frees its row and pages; a waiting one
        leaves the queue. Finishing a finished sequence does nothing."""
        if seq.finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.row < 0 and seq in self.waiting:  # waiting, not released after its last command
            self.waiting.remove(seq)
        self._release(seq)
        self._drop_lora(seq)

    def forget_cache(self) -> int:
        """New weights: no page written before may be found again, in use or not, and running
        rows register nothing more (their K/V mixes the two). Returns the pages forgotten."""
        for seq in self.running.values():
            if seq.cursor is not None:
                seq.cursor.serial = -1
        return self.pages.reset_prefix_cache(in_use=True)

    def requeue(self, seqs: list[Sequence]) -> None:
        """The children restarted with an empty KV cache and no rows: every unfinished sequence
        that ran goes back to waiting as a preempted one does (oldest first, ahead of those that
        were waiting), the pool and its prefix cache start empty, and no finished row is pending.
        A sequence with no token yet restarts as new, so that its prompt logprobs, lost with the
        commands in flight, are computed again."""
        ran = [s for s in seqs if not s.finished and (s.row >= 0 or s.fed > 0)]
        for seq in sorted(ran, key=lambda s: s.admit_order, reverse=True):
            self._preempt(seq, resumed=bool(seq.tokens))
        self.pages = self._new_pool()
        self.pending_finish = []
        if self.loras is not None:  # the children's adapter slots are empty too
            self.loras.reset_slots()
            self.lora_loads = []
            for seq in seqs:
                seq.lora_slot = -1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- internals -------------------------------------------------------------------------------
    def _whole_budget(self, decoding: int) -> bool:
        """Whether this step's prompts may take the whole token budget rather than the time cap:
        with no row decoding, no time estimate yet, or a burst: more prompts starting (under way,
        or waiting with a free row to take) than rows decoding. Letting a burst in at once delays
        those few rows once; capped, it would delay every row for many steps, the new ones too as
        they join, and keep the batch small while it trickles in."""
        if not decoding or self.prefill_cap is None:
            return True
        free_rows = self.max_batch_size - len(self.running)
        starting = sum(1 for s in self.running.values() if s.prefilling) + min(len(self.waiting), free_rows)
        return starting > decoding

    def _decoding_tokens(self) -> int:
        return sum(1 for s in self.running.values() if not s.prefilling)

    def _prefilling_rows(self) -> list[Sequence]:
        return sorted((s for s in self.running.values() if s.prefilling), key=lambda s: s.admit_order)

    def _grow_decoding_rows(self) -> None:
        """Gives every decoding row the page its next input needs, preempting when dry."""
        k, page = self.k, self.page_size
        # Positions a step may write: its input's, and with speculation k drafts after it.
        ends = [(s, min(s.fed + k + 1, s.kv_end) if k else s.fed + 1) for s in self.running.values()
                if not s.prefilling]
        short = [(s, end) for s, end in ends if end > len(s.pages) * page]  # most steps: none
        for seq, end in sorted(short, key=lambda pair: pair[0].admit_order):  # the oldest first
            while seq.row >= 0 and not self._extend(seq, end):  # (a preempted one has no row)
                self._preempt_newest()

    def _extend(self, seq: Sequence, end: int) -> bool:
        """Pages so that positions [0, end) have a page; False when the pool is dry."""
        missing = self.pages.pages_for(end) - len(seq.pages)
        if missing <= 0:
            return True
        got = self.pages.allocate(missing)
        if got is None:
            return False
        seq.pages += got
        return True

    def _preempt_newest(self) -> None:
        """The victim: the lowest priority, then the newest (all priorities are 0 under fcfs)."""
        self._preempt(max(self.running.values(), key=_victim_key))
        self.num_preemptions += 1

    def _make_room_for_better(self) -> None:
        """While the best waiting sequence lacks a row or pages for its first chunk, the worst
        running one that it outranks is preempted for it."""
        while self.waiting:
            best = self.waiting[0]
            running = list(self.running.values())
            need = self.pages.pages_for(min(best.known, self.budget))
            if not running or (len(running) < self.max_batch_size and self.pages.num_free + self.pages.num_evictable >= need):
                return
            worst = max(running, key=_victim_key)
            if worst.params.priority <= best.params.priority:
                return
            self._preempt(worst)
            self.num_preemptions += 1

    def _wait_in_rank(self, seq: Sequence) -> None:
        """Into waiting before the first sequence it ranks before: (priority, arrival)."""
        rank = (seq.params.priority, seq.arrival, seq.seq_id)
        for i, other in enumerate(self.waiting):
            if rank < (other.params.priority, other.arrival, other.seq_id):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def _preempt(self, victim: Sequence, resumed: bool = True) -> None:
        """Back to the head of the queue; its commands in flight no longer count (epoch), and it
        resumes by prefilling what it holds (`resumed`: as a preempted sequence)."""
        self._release(victim)
        victim.epoch += 1
        victim.preemptions += resumed
        victim.fed = victim.inflight = victim.blocks_sent = 0
        victim.scheduled = len(victim.tokens)
        if self.priority:
            self._wait_in_rank(victim)
        else:
            self.waiting.appendleft(victim)

    def _new_pool(self) -> PagePool:
        num_pages, page_size, prefix_caching, host_pages = self._pool_args
        return PagePool(num_pages, page_size, enable_prefix_caching=prefix_caching, host_pages=host_pages)

    def _schedule_chunk(self, seq: Sequence, room: int, chunks: list, staging: list, scoring: list,
                        triples: list, first_block: int | None = None) -> int:
        """The next piece of `seq`'s prompt (plus its tokens, on a resume) within `room` tokens.
        Page triples go out for blocks from `first_block` (default: the ones this chunk adds)."""
        length = min(seq.prefill_end - seq.fed, room)
        # Prompt log-probabilities of a chunk that stops inside the prompt need the next id too:
        # staged after the chunk, counted in the budget.
        wants_scores = seq.want_prompt_logprobs and seq.preemptions == 0 and seq.fed < seq.prompt_len - 1
        lookahead = wants_scores and seq.fed + length < seq.prompt_len
        if lookahead:
            length = min(length, room - 1)
        if length <= 0:
            return 0
        have = len(seq.pages) if first_block is None else first_block
        while not self._extend(seq, seq.fed + length):
            if self._newest_other(seq) is None:  # the newest waits for pages instead of preempting
                length = len(seq.pages) * self.page_size - seq.fed
                if length <= 0:
                    return 0
                break
            self._preempt_newest()
        triples.extend((seq.row, block, seq.pages[block]) for block in range(have, len(seq.pages)))
        seq.blocks_sent = len(seq.pages)
        offset = sum(len(ids) for _, ids in staging)
        start = seq.fed
        last = start + length == seq.prefill_end
        lookahead = lookahead and start + length < seq.prompt_len
        chunks.append(Chunk(seq.row, start, length, offset, last))
        staging.append((offset, seq.ids[start:start + length + lookahead]))
        if wants_scores:
            scoring.append((offset, start, length, seq))
        seq.fed += length
        if last:
            seq.scheduled += 1
        return length + lookahead

    def _newest_other(self, seq: Sequence) -> Sequence | None:
        """A running sequence that would be preempted before `seq` (lower priority, or newer)."""
        others = [s for s in self.running.values() if s is not seq and _victim_key(s) > _victim_key(seq)]
        return max(others, key=_victim_key) if others else None

    def _admit(self, used: int, limit: int, chunks: list, staging: list, scoring: list, triples: list) -> list[Admit]:
        """Admits waiting sequences into free rows while the step has room (`limit` tokens)."""
        admits: list[Admit] = []
        if not self.waiting:  # most steps: no scan of the rows
            return admits
        free_rows = [i for i in range(self.max_batch_size) if i not in self.running]
        while self.waiting and free_rows and used < limit:
            seq = self.waiting[0]
            if seq.suspect and self._other_suspect_running(seq):
                break  # one suspect of a failure at a time, so that the next failure names its cause
            if seq.lora is not None and seq.lora_slot < 0:
                held = self.loras.acquire(seq.lora)
                if held is None:
                    break  # every adapter slot is held by running rows of other adapters
                seq.lora_slot, load = held
                if load is not None:
                    self.lora_loads.append((seq.lora_slot, load))
            # No cache hit where every position must be computed: prompt log-probabilities need the
            # logits of each, and penalties count the ids of each chunk.
            computes_all = (seq.want_prompt_logprobs and seq.preemptions == 0) or seq.params.uses_penalties
            root = seq.lora.root if seq.lora is not None else ROOT_HASH  # adapters never share pages
            # A request that computes every position still registers its pages, on its own chain.
            hit = PrefixHit([], 0, CacheCursor(hash=root)) if computes_all else self.pages.lookup(seq.ids[:seq.known],
                                                                                                  root)
            first_end = min(seq.known, hit.num_tokens + limit - used)
            missing = self.pages.pages_for(first_end) - len(hit.pages)
            new = self.pages.allocate(missing) if missing > 0 else []
            if new is None:
                self.pages.cancel_lookup(hit)
                break  # head-of-line waits for pages: keeps arrival order
            self.waiting.popleft()
            seq.row = free_rows.pop(0)
            seq.pages, seq.cursor = hit.pages + new, hit.cursor
            seq.fed, seq.prefill_end = hit.num_tokens, seq.known
            if seq.preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
                seq.admitted_at = time.perf_counter()
            seq.admit_order = next(self._admissions)
            self.running[seq.row] = seq
            values = seq.row_values()
            if self.k and hit.num_tokens:  # the child's token history needs the ids its chunks skip
                values["cached_ids"] = seq.ids[:hit.num_tokens]
            admits.append(Admit(seq.row, **values))
            used += self._schedule_chunk(seq, limit - used, chunks, staging, scoring, triples, first_block=0)
        return admits

    def _other_suspect_running(self, seq: Sequence) -> bool:
        return any(r.suspect and r.request_id != seq.request_id for r in self.running.values())

    def _commit(self, seq: Sequence) -> None:
        """Registers the sequence's full pages whose ids are final and whose K/V a sent command writes."""
        cursor = seq.cursor
        if cursor is not None and seq.row >= 0:
            # Speculating, `fed` is a bound: only positions before the last known token surely hold K/V.
            written = min(seq.known - 1, seq.fed) if self.k else min(seq.known, seq.fed)
            if written >= (cursor.num_pages + 1) * self.page_size:  # a page filled since (called per token)
                self.pages.commit(cursor, seq.pages, seq.ids, written)

    def _release(self, seq: Sequence) -> None:
        """Frees the row and pages now; the child deactivates the row at the start of the next
        command, before anything it computes, and commands run in order, so reuse is safe."""
        if seq.row < 0 or self.running.get(seq.row) is not seq:
            return
        self._commit(seq)
        del self.running[seq.row]
        self.pending_finish.append(seq.row)
        self.pages.free(seq.pages)
        seq.pages, seq.cursor, seq.row = [], None, -1
        self._drop_lora(seq)

    def _drop_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.loras.release(seq.lora_slot)
        seq.lora_slot = -1

    def _take_finished(self) -> list[int]:
        rows, self.pending_finish = self.pending_finish, []
        return rows

    def _full_state(self, producers: list[tuple[int, Sequence]]) -> FullState:
        """copy_policy="always": rebuild every decode input from scratch, as older systems did.
        Speculating, positions and slots are left out: acceptance moves them on the device, and
        `fed` is only a bound on them while steps are in flight."""
        b, page = self.max_batch_size, self.page_size
        positions, active = np.zeros(b, np.int64), np.zeros(b, bool)
        block_table, slot_mapping = np.zeros((b, self.max_blocks), np.int32), np.zeros(b, np.int64)
        for row, seq in producers:
            active[row] = True
            block_table[row, :len(seq.pages)] = seq.pages
            if not self.k:
                pos = seq.fed - 1  # this step's input position (fed was advanced when scheduling)
                positions[row] = pos
                slot_mapping[row] = seq.pages[pos // page] * page + pos % page
        values = ((row, seq.row_values()) for row, seq in producers)
        if self.k:
            return FullState.from_rows(None, active, block_table, None, values)
        return FullState.from_rows(positions, active, block_table, slot_mapping, values)


def _victim_key(seq: Sequence) -> tuple[int, int]:
    """Preemption order, greatest first: the lowest priority (the largest number), then the newest."""
    return seq.params.priority, seq.admit_order
