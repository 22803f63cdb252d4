"""The scheduler against a simulated device that applies its commands as the chip runtime does.

The simulated device keeps, for every KV slot, the token id written there; a row's next token
is a hash of the ids it reads back through its block table for positions 0..p. A wrong prefix
hit, a page reused while still read, a missing page triple or a chunk at the wrong position
changes what a row reads, so its tokens differ from a run with a large pool, no prefix cache and
no chunking. Every variant must give exactly that run's tokens.
"""
from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from chip_child.protocol import Command
from l3worker.params import SamplingParams
from l3worker.engine.scheduler import Scheduler, Sequence

VOCAB = 97
PAGE = 4


class SimulatedDevice:
    def __init__(self, rows: int):
        self.slots: dict[int, int] = {}  # slot -> token id
        self.host: dict[int, int] = {}  # the host tier's slots, the same way
        self.table = [dict() for _ in range(rows)]  # row -> {block: page}
        self.active = [False] * rows
        self.pos = [0] * rows  # the next input's position
        self.input = [0] * rows  # the next input token (the last sampled one)

    def slot(self, row: int, position: int) -> int:
        page = self.table[row].get(position // PAGE)
        assert page is not None and page > 0, f"row {row} reads position {position} without a page"
        return page * PAGE + position % PAGE

    def context(self, row: int, length: int) -> list[int]:
        ids = []
        for p in range(length):
            s = self.slot(row, p)
            assert s in self.slots, f"row {row} reads position {p}, never written"
            ids.append(self.slots[s])
        return ids

    def copy(self, copies: np.ndarray | None) -> None:
        """The host tier's page copies (kind 0: page -> slot, 1: slot -> page), in order."""
        for kind, page, slot in ([] if copies is None else copies.tolist()):
            src, dst = (self.slots, self.host) if kind == 0 else (self.host, self.slots)
            i, j = (page, slot) if kind == 0 else (slot, page)
            for off in range(PAGE):
                if i * PAGE + off in src:
                    dst[j * PAGE + off] = src[i * PAGE + off]
                else:
                    dst.pop(j * PAGE + off, None)

    def execute(self, cmd: Command, staging: np.ndarray) -> np.ndarray:
        for r in cmd.finished_rows:
            self.active[r] = False
        for a in cmd.admits:
            self.active[a.row], self.table[a.row] = False, {}
        for row, block, page in cmd.new_pages.tolist():
            self.table[row][block] = page
        decode = [r for r, on in enumerate(self.active) if on]
        for r in decode:  # every write of the step lands before any read
            self.slots[self.slot(r, self.pos[r])] = self.input[r]
        for c in cmd.chunks:
            for i in range(c.length):
                self.slots[self.slot(c.row, c.start + i)] = int(staging[c.staging_offset + i])
        out = np.full(len(self.active), -1, np.int32)
        for r in decode:
            self.pos[r] += 1
            out[r] = self.input[r] = next_token(self.context(r, self.pos[r]))
        for c in cmd.chunks:
            if c.last:
                self.pos[c.row], self.active[c.row] = c.start + c.length, True
                out[c.row] = self.input[c.row] = next_token(self.context(c.row, self.pos[c.row]))
        return out


def next_token(context: list[int]) -> int:
    h = len(context)
    for t in context[-6:]:
        h = (h * 1_000_003 + t * 7919) % 2_147_483_647
    return 1 + h % (VOCAB - 1)


def make_seqs(prompts: list[list[int]], new_tokens: list[int], priorities: list[int] | None = None) -> list[Sequence]:
    priorities = priorities or [0] * len(prompts)
    return [Sequence(i, 0, np.array(p, np.int32), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True,
                                                                 priority=q), 0,
                     frozenset(), request_id=str(i), arrival=float(i))
            for i, (p, n, q) in enumerate(zip(prompts, new_tokens, priorities))]


def run(prompts, new_tokens, *, rows=4, num_pages=400, budget=10_000, caching=False, depth=1,
        abort_at: dict[int, int] | None = None, arrivals: dict[int, int] | None = None,
        priorities: list[int] | None = None, host_pages: int = 0,
        prefill_cap: int | None = None) -> tuple[dict, Scheduler]:
    """Token ids per sequence; `abort_at` aborts sequence i once it has that many tokens,
    `arrivals` adds sequence i before step k instead of at the start; `priorities` turns the
    priority policy on."""
    sched = Scheduler(max_batch_size=rows, page_size=PAGE, max_blocks_per_row=64, num_pages=num_pages,
                      max_num_batched_tokens=budget, enable_prefix_caching=caching, full_state=False,
                      priority=priorities is not None, host_pages=host_pages)
    sched.prefill_cap = prefill_cap
    dev = SimulatedDevice(rows)
    seqs = make_seqs(prompts, new_tokens, priorities)
    assert all(s.pages_needed(PAGE) <= num_pages for s in seqs)  # the engine refuses larger ones up front
    arrivals = arrivals or {}
    sched.add([s for i, s in enumerate(seqs) if i not in arrivals])
    inflight: deque = deque()
    for step in range(20_000):
        for i, at in arrivals.items():
            if at == step:
                sched.add([seqs[i]])
        while len(inflight) < depth and (s := sched.next_command()) is not None:
            staging = np.zeros(budget + rows, np.int32)
            for offset, ids in s.staging_tokens:
                staging[offset:offset + len(ids)] = ids
            dev.copy(sched.pages.take_copies())  # before the command, as the engine sends them
            inflight.append((s, dev.execute(s.command, staging)))
        if not inflight:
            if all(s.finished for s in seqs) and step > max(arrivals.values(), default=0):
                break
            continue
        s, ids = inflight.popleft()
        sched.on_tokens(s.producers, ids, float(step))
        # The occupied rows are keyed by each sequence's own row, within the batch.
        assert all(q.row == i and 0 <= i < rows for i, q in sched.running.items())
        for i, n in (abort_at or {}).items():
            if len(seqs[i].tokens) >= n:
                sched.finish(seqs[i], "abort")
    else:
        pytest.fail("the scheduler did not finish")
    sched.pages.check()
    assert sched.idle and sched.pages.num_free == num_pages  # every page back (free or cached)
    return {s.seq_id: list(s.tokens) for s in seqs}, sched


def workload(seed: int, n: int = 10, shared: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    return prompts, [rng.randrange(1, 25) for _ in range(n)]


@pytest.mark.parametrize("budget", [5, 8, 13, 64])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_chunked_prefill_gives_the_same_tokens(budget: int, depth: int) -> None:
    prompts, new = workload(1)
    want, _ = run(prompts, new)
    got, _ = run(prompts, new, budget=budget, depth=depth)
    assert got == want


def test_decoding_rows_advance_every_step_while_a_long_prompt_prefills() -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(5)] for _ in range(3)] + [[7] * 200]
    new = [60, 60, 60, 2]
    sched = Scheduler(max_batch_size=4, page_size=PAGE, max_blocks_per_row=64, num_pages=200,
                      max_num_batched_tokens=16, enable_prefix_caching=False, full_state=False)
    seqs = make_seqs(prompts, new)
    sched.add(seqs[:3])
    dev = SimulatedDevice(4)
    for _ in range(6):  # the three short ones are decoding
        s = sched.next_command()
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s)), 0.0)
    sched.add(seqs[3:])
    steps_with_chunk = 0
    while seqs[3].prefilling or seqs[3].row < 0:
        s = sched.next_command()
        before = [len(q.tokens) for q in seqs[:3]]
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s)), 0.0)
        assert all(len(q.tokens) == b + 1 for q, b in zip(seqs[:3], before))
        assert sum(c.length for c in s.command.chunks) + 3 <= 16
        steps_with_chunk += bool(s.command.chunks)
    assert steps_with_chunk >= 200 // 16


def test_a_prefill_cap_bounds_the_prompt_tokens_of_decoding_steps_only() -> None:
    """Scheduler.prefill_cap (set from step times by the step loop): a step with decoding rows
    carries at most that many prompt tokens, whatever the token budget; a step without any takes
    the whole budget (a lone prompt's first chunk is not slowed)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(3)] + [[7] * 100]
    sched = Scheduler(max_batch_size=4, page_size=PAGE, max_blocks_per_row=64, num_pages=200,
                      max_num_batched_tokens=64, enable_prefix_caching=False, full_state=False)
    sched.prefill_cap = 5
    seqs = make_seqs(prompts, [30, 30, 30, 2])
    sched.add(seqs[:3])
    dev = SimulatedDevice(4)
    first = sched.next_command()  # nothing decodes yet: the budget alone
    assert sum(c.length for c in first.command.chunks) == 64
    sched.on_tokens(first.producers, dev.execute(first.command, _staging(first, 128)), 0.0)
    second = sched.next_command()  # two prompts under way, one row decoding: a burst, the budget too
    assert sum(c.length for c in second.command.chunks) == 56
    sched.on_tokens(second.producers, dev.execute(second.command, _staging(second, 128)), 0.0)
    sched.add(seqs[3:])  # one prompt starting, three rows decoding: capped
    while seqs[3].prefilling or seqs[3].row < 0:
        s = sched.next_command()
        decoding = sum(1 for row, seq, _ in s.producers if not any(c.row == row for c in s.command.chunks))
        if decoding:
            assert sum(c.length for c in s.command.chunks) <= 5
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s, 128)), 0.0)


def test_a_burst_of_prompts_takes_the_whole_budget_beside_fewer_decoding_rows() -> None:
    """A burst (more prompts starting than rows decoding) is let in at once, past prefill_cap: one
    row decodes and three prompts arrive, so the next step carries all three; once the rows that
    decode outnumber those starting, a newcomer is capped again."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(20)] for _ in range(6)]
    sched = Scheduler(max_batch_size=6, page_size=PAGE, max_blocks_per_row=64, num_pages=200,
                      max_num_batched_tokens=256, enable_prefix_caching=False, full_state=False)
    sched.prefill_cap = 5
    seqs = make_seqs(prompts, [40] * 6)
    dev = SimulatedDevice(6)

    def step() -> int:
        s = sched.next_command()
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s, 512)), 0.0)
        return sum(c.length for c in s.command.chunks)

    sched.add(seqs[:1])
    assert step() == 20 and not seqs[0].prefilling  # alone: the budget
    sched.add(seqs[1:4])
    assert step() == 60  # 3 starting > 1 decoding: all three prompts in one step
    assert not any(s.prefilling for s in seqs[:4])
    sched.add(seqs[4:6])
    assert step() == 5  # 2 starting against 4 decoding: the cap
    assert seqs[4].prefilling


@pytest.mark.parametrize("cap", [1, 3, 7])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_prefill_cap_gives_the_same_tokens(cap: int, depth: int) -> None:
    prompts, new = workload(4, n=12)
    want, _ = run(prompts, new, budget=13)
    got, _ = run(prompts, new, budget=13, depth=depth, prefill_cap=cap, arrivals={i: 3 * i for i in range(4, 12)})
    assert got == want


def _staging(s, size: int = 64) -> np.ndarray:
    staging = np.zeros(size, np.int32)
    for offset, ids in s.staging_tokens:
        staging[offset:offset + len(ids)] = ids
    return staging


@pytest.mark.parametrize("shared", [PAGE - 1, PAGE, PAGE + 1, 3 * PAGE, 3 * PAGE + 2])
def test_prefix_caching_hits_and_gives_the_same_tokens(shared: int) -> None:
    prompts, new = workload(3, shared=shared)
    want, _ = run(prompts, new)
    arrivals = {i: 40 * i for i in range(1, len(prompts))}  # later requests find earlier pages cached
    got, sched = run(prompts, new, caching=True, arrivals=arrivals, budget=9, depth=2)
    assert got == want
    if shared >= PAGE:
        assert sched.pages.hits_tokens >= (len(prompts) - 1) * (shared // PAGE) * PAGE


def test_multi_turn_prompts_reuse_the_previous_turn() -> None:
    rng = random.Random(4)
    turn = [rng.randrange(1, VOCAB) for _ in range(10)]
    first, _ = run([turn], [12])
    second_prompt = turn + first[0] + [5, 6, 7]
    want, _ = run([turn, second_prompt], [12, 8])
    got, sched = run([turn, second_prompt], [12, 8], caching=True, arrivals={1: 60})
    assert got == want
    assert sched.pages.hits_tokens >= (len(turn) + 12 - 1) // PAGE * PAGE - PAGE


@pytest.mark.parametrize("num_pages", [15, 18, 24])  # the largest sequence needs 15
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_when_pages_run_out_gives_the_same_tokens(num_pages: int, caching: bool) -> None:
    prompts, new = workload(5, n=12, shared=PAGE + 2)
    want, _ = run(prompts, new)
    got, sched = run(prompts, new, num_pages=num_pages, caching=caching, budget=11, depth=2)
    assert got == want
    assert sched.num_preemptions > 0


def test_eviction_pressure_with_prefix_caching() -> None:
    prompts, new = workload(6, n=30, shared=2 * PAGE)
    want, _ = run(prompts, new)
    arrivals = {i: 7 * i for i in range(len(prompts))}
    got, sched = run(prompts, new, num_pages=20, caching=True, arrivals=arrivals, depth=2)
    assert got == want
    assert sched.pages.evicted_pages > 0 and sched.pages.hits_tokens > 0


def test_aborts_mid_prefill_and_mid_decode_leave_the_others_unchanged() -> None:
    prompts, new = workload(7)
    new = [20] * len(new)
    want, _ = run(prompts, new)
    got, _ = run(prompts, new, budget=7, depth=2, caching=True, abort_at={0: 0, 3: 5})
    assert {k: v for k, v in got.items() if k not in (0, 3)} == {k: v for k, v in want.items() if k not in (0, 3)}
    assert got[3] == want[3][:len(got[3])]


# -- scheduling_policy="priority" --------------------------------------------------------------------
def test_a_better_priority_arrival_takes_a_row_at_the_next_step() -> None:
    """A priority-0 request arriving at a full batch of priority-10 rows is admitted by the very
    next command; the newest of the lowest priority is the one preempted, and resumes later."""
    sched = Scheduler(max_batch_size=2, page_size=PAGE, max_blocks_per_row=64, num_pages=200,
                      max_num_batched_tokens=64, enable_prefix_caching=False, full_state=False, priority=True)
    dev = SimulatedDevice(2)
    low = make_seqs([[1, 2, 3], [4, 5, 6]], [40, 40], [10, 10])
    sched.add(low)
    for step in range(5):
        s = sched.next_command()
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s)), float(step))
    assert [q.row for q in low] == [0, 1] and not sched.waiting
    urgent = make_seqs([[9, 9]], [5], [0])[0]
    urgent.seq_id, urgent.request_id = 2, "2"
    sched.add([urgent])
    s = sched.next_command()
    assert [a.row for a in s.command.admits] == [urgent.row] == [1]  # the newest priority-10 row's
    assert low[1].row == -1 and low[1].preemptions == 1 and list(sched.waiting) == [low[1]]
    assert sched.num_preemptions == 1


def test_waiting_requests_start_in_priority_then_arrival_order() -> None:
    sched = Scheduler(max_batch_size=1, page_size=PAGE, max_blocks_per_row=64, num_pages=200,
                      max_num_batched_tokens=64, enable_prefix_caching=False, full_state=False, priority=True)
    dev = SimulatedDevice(1)
    seqs = make_seqs([[i + 1] * 3 for i in range(6)], [3] * 6, [5, 1, 5, 0, 1, 9])
    sched.add(seqs)
    started: list[int] = []
    for step in range(100):
        s = sched.next_command()
        if s is None:
            break
        started += [sched.running[a.row].seq_id for a in s.command.admits]
        sched.on_tokens(s.producers, dev.execute(s.command, _staging(s)), float(step))
    assert started == [3, 1, 4, 0, 2, 5] and sched.num_preemptions == 0


@pytest.mark.parametrize("num_pages", [12, 30, 400])
def test_priority_preemption_gives_the_same_tokens(num_pages: int) -> None:
    """Arrivals of mixed priorities over a busy batch: whatever is preempted for whom, and however
    often, every sequence's tokens equal those of a large fcfs run."""
    prompts, new = workload(7, n=12)
    want, _ = run(prompts, new)
    rng = random.Random(3)
    priorities = [rng.choice([0, 1, 5, 10]) for _ in prompts]
    arrivals = {i: 3 * i for i in range(4, 12)}
    got, sched = run(prompts, new, rows=3, num_pages=num_pages, priorities=priorities, arrivals=arrivals, depth=2)
    assert got == want and sched.num_preemptions > 0


# -- the prefix cache's host tier ----------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_pages,host_pages", [(18, 6), (24, 40), (30, 200)])
def test_a_host_tier_gives_the_same_tokens_and_brings_prefixes_back(depth, num_pages, host_pages) -> None:
    """Shared and repeated prefixes over a pool too small for them: pages go to the host tier and
    come back by copy; a wrong copy, one in the wrong order, or one a later store overwrote would
    change what a row reads."""
    prompts, new = workload(4, n=16, shared=12)
    prompts = prompts + prompts[:8]  # a second round of half of them
    new = new + new[:8]
    want, _ = run(prompts, new)
    got, sched = run(prompts, new, rows=3, num_pages=num_pages, caching=True, budget=13, depth=depth,
                     host_pages=host_pages)
    assert got == want
    assert sched.pages.host.stored_pages > 0 and sched.pages.host.loaded_pages > 0
