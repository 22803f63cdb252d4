"""The KV page pool: allocation on demand, reference counts, prefix caching and LRU eviction."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from l3worker.engine import page_pool
from l3worker.engine.page_pool import PagePool

PS = 4  # page size in these tests


def tokens(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def prefill(pool: PagePool, ids, *, commit: bool = True):
    """Admits a request as the scheduler would: lookup, pages for the rest, then commits every
    full page once its K/V is written. Returns (pages, cursor, hit)."""
    hit = pool.lookup(ids)
    new = pool.allocate(pool.pages_for(len(ids)) - len(hit.pages))
    assert new is not None
    pages = hit.pages + new
    if commit:
        pool.commit(hit.cursor, pages, ids, len(ids))
    return pages, hit.cursor, hit


def snapshot(pool: PagePool):
    return (list(pool._free), list(pool._lru), list(pool._ref), dict(pool._table), pool.num_free, pool.num_cached)


# -- allocation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_allocate_free_round_trip_restores_counts(caching):
    pool = PagePool(10, PS, enable_prefix_caching=caching)
    assert (pool.num_free, pool.num_used, pool.num_cached, pool.usage) == (10, 0, 0, 0.0)
    a = pool.allocate(3)
    assert (pool.num_free, pool.num_used, pool.usage) == (7, 3, 0.3)
    b = pool.allocate(7)
    assert sorted(a + b) == list(range(1, 11))  # page 0 is never handed out
    assert pool.allocate(1) is None and pool.num_free == 0 and pool.usage == 1.0
    assert pool.allocate(0) == []
    pool.check()
    pool.free(a)
    pool.free(b)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (10, 0, 0)
    pool.check()
    assert sorted(pool.allocate(10)) == list(range(1, 11))
    pool.check()


def test_full_pool_allocation_returns_none_and_takes_nothing():
    pool = PagePool(8, PS)
    pages, _, _ = prefill(pool, tokens(2 * PS))  # two full pages, cached
    pool.free(pages)  # evictable
    held = pool.allocate(3)
    assert (pool.num_free, pool.num_evictable, pool.num_cached) == (5, 2, 2)
    before = snapshot(pool)
    assert pool.allocate(6) is None
    assert snapshot(pool) == before
    pool.check()
    got = pool.allocate(5)  # takes the 3 free pages, then evicts both cached ones
    assert len(got) == 5 and set(got).isdisjoint(held)
    assert (pool.num_free, pool.num_cached, pool.evicted_pages) == (0, 0, 2)
    assert pool.allocate(1) is None
    pool.check()


def test_bad_frees_raise():
    pool = PagePool(4, PS)
    (page,) = pool.allocate(1)
    pool.free([page])
    with pytest.raises(ValueError):
        pool.free([page])
    with pytest.raises(ValueError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check()


# -- prefix hits --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_prefix_hits_at_every_page_boundary(k, delta):
    n = k * PS + delta
    pool = PagePool(32, PS)
    ids = tokens(n, seed=n)
    a_pages, _, a_hit = prefill(pool, ids)
    assert a_hit.pages == [] and a_hit.num_tokens == 0
    assert pool.num_cached == n // PS  # every full page of the prompt

    # The same prompt again: every cached page but never its last token.
    hit = pool.lookup(ids)
    expect = (n - 1) // PS
    assert hit.pages == a_pages[:expect] and hit.num_tokens == expect * PS
    assert hit.cursor.num_pages == expect

    # A longer request sharing the whole prompt gets every full page of it.
    longer = pool.lookup(ids + tokens(2 * PS, seed=99))
    assert longer.pages == a_pages[:n // PS]

    # A request that differs at position p gets only the pages before p.
    for p in range(n):
        other = list(ids)
        other[p] += 1
        h = pool.lookup(other)
        assert h.pages == a_pages[:min(p // PS, (n - 1) // PS)]
        pool.cancel_lookup(h)
    pool.check()


def test_last_token_cap():
    pool = PagePool(16, PS)
    ids = tokens(2 * PS)
    pages, cursor, _ = prefill(pool, ids)
    assert cursor.num_pages == 2 and pool.is_cached(pages[0]) and pool.is_cached(pages[1])
    assert pool.lookup(ids).pages == pages[:1]  # (2 * PS - 1) // PS: the last token is computed
    assert pool.lookup(ids[:PS]).pages == []
    assert pool.lookup(ids[:PS + 1]).pages == pages[:1]
    assert pool.lookup(ids + [7]).pages == pages
    empty = pool.lookup([])
    assert empty.pages == [] and empty.num_tokens == 0
    pool.check()


def test_counters_in_tokens_and_cancel_lookup():
    pool = PagePool(16, PS)
    ids = tokens(3 * PS + 1)
    pages, _, _ = prefill(pool, ids)
    assert (pool.queries_tokens, pool.hits_tokens) == (len(ids), 0)
    hit = pool.lookup(ids)
    assert (pool.queries_tokens, pool.hits_tokens) == (2 * len(ids), 3 * PS)
    assert [pool.refcount(p) for p in hit.pages] == [2, 2, 2]
    pool.free(pages)
    before_free = pool.num_free
    pool.cancel_lookup(hit)  # not admitted: references and counts go back
    assert (pool.queries_tokens, pool.hits_tokens) == (len(ids), 0)
    assert pool.num_free == before_free + 3 and pool.num_used == 0 and pool.num_cached == 3
    pool.check()


def test_numpy_and_list_ids_hit_the_same_pages():
    pool = PagePool(16, PS)
    ids = tokens(3 * PS)
    pages, _, _ = prefill(pool, np.array(ids, np.int32))
    assert pool.lookup(ids + [1]).pages == pages
    assert pool.lookup(np.array(ids + [1], np.int64)).pages == pages
    assert pool.lookup(tuple(ids) + (1,)).pages == pages
    pool.check()


def test_shared_pages_are_refcounted():
    pool = PagePool(16, PS)
    ids = tokens(3 * PS + 2)
    a_pages, _, _ = prefill(pool, ids)  # 3 full pages cached + a private partial page
    b_pages, _, b_hit = prefill(pool, ids)
    c_pages, _, c_hit = prefill(pool, ids[:2 * PS + 1])
    assert b_hit.pages == a_pages[:3] and c_hit.pages == a_pages[:2]
    assert [pool.refcount(p) for p in a_pages] == [3, 3, 2, 1]
    assert b_pages[3] != a_pages[3] and c_pages[2] not in a_pages
    used = pool.num_used
    assert used == 4 + 1 + 1
    pool.free(b_pages)
    assert [pool.refcount(p) for p in a_pages] == [2, 2, 1, 1]
    pool.free(a_pages)
    assert [pool.refcount(p) for p in a_pages] == [1, 1, 0, 0]
    assert pool.is_cached(a_pages[2]) and not pool.is_cached(a_pages[3])
    pool.free(c_pages)
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_evictable == 3
    assert pool.num_free == 16
    pool.check()


# -- eviction ---------------------------------------------------------------------------------------------
def test_lru_eviction_order_and_pages_in_use_are_kept():
    pool = PagePool(6, 2)
    reqs = {name: tokens(4, seed=s) for s, name in enumerate("ABC")}
    pages = {name: prefill(pool, ids)[0] for name, ids in reqs.items()}  # two cached pages each
    assert pool.num_free == 0 and pool.num_cached == 6
    for name in "ABC":
        pool.free(pages[name])  # a request's tail page goes before its head
    hit = pool.lookup(reqs["A"] + [5])  # A used again: now the most recent
    assert hit.pages == pages["A"]
    pool.free(hit.pages)
    expected = [pages["B"][1], pages["B"][0], pages["C"][1], pages["C"][0], pages["A"][1], pages["A"][0]]
    assert list(pool._lru) == expected
    evicted = []
    for _ in range(4):
        (page,) = pool.allocate(1)
        evicted.append(page)
        assert not pool.is_cached(page)
        pool.check()
    assert evicted == expected[:4]
    assert pool.lookup(reqs["B"] + [5]).pages == []

    # A held by a request: its pages are never evicted, whatever the pressure.
    held = pool.lookup(reqs["A"] + [5])
    assert held.pages == pages["A"]
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(evicted)
    assert sorted(pool.allocate(4)) == sorted(evicted)
    assert all(pool.is_cached(p) and pool.refcount(p) == 1 for p in pages["A"])
    pool.check()


def test_reset_prefix_cache_drops_evictable_pages_only():
    pool = PagePool(16, PS)
    a = tokens(2 * PS + 1, seed=1)
    b = tokens(2 * PS + 1, seed=2)
    a_pages, _, _ = prefill(pool, a)
    b_pages, _, _ = prefill(pool, b)
    pool.free(a_pages)
    assert pool.num_cached == 4
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached == 2 and pool.num_evictable == 0 and pool.num_free == 16 - 3
    assert pool.lookup(a).pages == []
    assert pool.lookup(b).pages == b_pages[:2]
    pool.check()


# -- duplicates, collisions, broken chains -------------------------------------------------------------------
def test_same_prefix_prefilled_twice_shares_the_cached_copy():
    pool = PagePool(16, PS)
    ids = tokens(2 * PS + 1)
    a_pages, a_cur, _ = prefill(pool, ids, commit=False)
    b_pages, b_cur, _ = prefill(pool, ids, commit=False)  # admitted before A committed
    assert pool.commit(a_cur, a_pages, ids, len(ids)) == 2
    assert pool.commit(b_cur, b_pages, ids, len(ids)) == 0  # A's copy is in use: B's stays private
    assert not pool.is_cached(b_pages[0]) and b_cur.page == a_pages[1]
    # B grows a third full page: it chains on A's copy, and a later request finds all three.
    grown = ids + tokens(PS - 1, seed=5)
    assert pool.commit(b_cur, b_pages, grown, len(grown)) == 1
    hit = pool.lookup(grown + [0])
    assert hit.pages == a_pages[:2] + [b_pages[2]]
    pool.cancel_lookup(hit)
    pool.free(a_pages)
    pool.free(b_pages)
    assert pool.num_cached == 3 and pool.num_evictable == 3 and pool.num_free == 16
    pool.check()


def test_unused_cached_copy_hands_its_entry_over():
    pool = PagePool(16, PS)
    ids = tokens(2 * PS + 1)
    a_pages, a_cur, _ = prefill(pool, ids, commit=False)
    b_pages, b_cur, _ = prefill(pool, ids, commit=False)
    pool.commit(a_cur, a_pages, ids, len(ids))
    grown = ids + tokens(PS - 1, seed=5)
    pool.commit(a_cur, a_pages, grown, len(grown))  # A's third page chains on its second
    pool.free(a_pages)  # A's copy is now unused
    assert pool.commit(b_cur, b_pages, ids, len(ids)) == 2  # B's pages take the entries over
    assert pool.is_cached(b_pages[0]) and not pool.is_cached(a_pages[0])
    assert pool.num_cached == 3
    # The entries kept their identity: A's third page is still reachable through B's pages.
    assert pool.lookup(grown + [0]).pages == b_pages[:2] + [a_pages[2]]
    pool.check()


def test_commit_after_the_parent_was_evicted_breaks_the_chain():
    pool = PagePool(8, PS)
    ids = tokens(2 * PS + 1)
    a_pages, a_cur, _ = prefill(pool, ids, commit=False)
    b_pages, b_cur, _ = prefill(pool, ids, commit=False)
    pool.commit(a_cur, a_pages, ids, len(ids))
    pool.commit(b_cur, b_pages, ids, len(ids))  # B chains through A's pages
    pool.free(a_pages)
    pool.allocate(pool.num_free)  # evicts A's cached pages
    assert pool.num_cached == 0
    grown = ids + tokens(PS - 1, seed=5)
    assert pool.commit(b_cur, b_pages, grown, len(grown)) == 0
    assert b_cur.serial == -1 and b_cur.num_pages == 3 and pool.num_cached == 0
    pool.check()


def test_forged_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(page_pool, "hash_page", lambda parent, ids: 12345)
    pool = PagePool(16, PS)
    a = tokens(2 * PS + 1, seed=1)
    b = tokens(2 * PS + 1, seed=2)
    a_pages, a_cur, _ = prefill(pool, a)
    # Every hash is the same: only A's first page could be entered; its second page collides
    # with its first, which is in use, so A's chain stops there.
    assert pool.num_cached == 1 and a_cur.serial == -1
    hit = pool.lookup(b)
    assert hit.pages == [] and pool.hits_tokens == 0
    assert pool.lookup(a).pages == a_pages[:1]  # the true match still hits
    pool.check()


def test_collision_deep_in_the_chain_is_not_a_hit(monkeypatch):
    """Two different first pages X and Z with one hash: a page cached after X must never be
    served after Z, even though its own ids and its parent's hash match."""
    real = page_pool.hash_page
    x, y, z = tokens(PS, seed=1), tokens(PS, seed=2), tokens(PS, seed=3)
    xb, zb = np.array(x, np.int32).tobytes(), np.array(z, np.int32).tobytes()
    monkeypatch.setattr(page_pool, "hash_page", lambda parent, ids: real(parent, xb if ids == zb else ids))
    pool = PagePool(16, PS)
    a_pages, _, _ = prefill(pool, x + y + [0])  # pages X, Y cached
    pool.free(a_pages)
    b = z + [0]
    b_pages, _, b_hit = prefill(pool, b)
    assert b_hit.pages == []  # Z's hash finds X's page; its ids differ: a miss
    assert pool.is_cached(b_pages[0]) and not pool.is_cached(a_pages[0])  # Z took the unused entry
    assert pool.is_cached(a_pages[1])  # Y (after X) is still cached, and its hash matches Z + Y
    c = z + y + [0]
    c_pages, c_cur, c_hit = prefill(pool, c)
    assert c_hit.pages == [b_pages[0]]  # but its parent is not Z's page: not a hit
    # C's own Y page (after Z) replaces the stale one, and the chain through it works.
    assert c_cur.num_pages == 2 and pool.is_cached(c_pages[1]) and not pool.is_cached(a_pages[1])
    assert pool.lookup(z + y + [1]).pages == c_pages[:2]
    pool.check()


def test_disabled_caching_never_hits():
    pool = PagePool(16, PS, enable_prefix_caching=False)
    ids = tokens(3 * PS + 1)
    pages, cursor, _ = prefill(pool, ids)
    assert pool.num_cached == 0 and not any(pool.is_cached(p) for p in pages)
    assert cursor.num_pages == 3
    hit = pool.lookup(ids)
    assert hit.pages == [] and hit.num_tokens == 0
    pool.free(pages)
    assert pool.num_free == 16 and pool.num_evictable == 0
    assert pool.lookup(ids).pages == []
    assert (pool.queries_tokens, pool.hits_tokens) == (0, 0)
    assert pool.reset_prefix_cache() == 0
    pool.check()


# -- randomized ------------------------------------------------------------------------------------------------
class _Req:
    def __init__(self, ids):
        self.ids = list(ids)
        self.pages: list[int] = []
        self.cursor = None


@pytest.mark.parametrize("hashing", ["real", "colliding"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants_and_return_the_right_ids(seed, hashing, monkeypatch):
    """Requests built from a few shared prefixes over a tiny vocabulary (many equal pages) are
    admitted, grown, finished, preempted and resumed; a shadow map of what was written into each
    page checks that every hit holds exactly the ids asked for."""
    if hashing == "colliding":
        real = page_pool.hash_page
        monkeypatch.setattr(page_pool, "hash_page", lambda parent, ids: real(parent, ids) & 3)
    rng = random.Random(seed)
    pool = PagePool(24, PS)
    bases = [tokens(24, seed=100 + i, vocab=3) for i in range(3)]
    shadow: dict[int, list] = {}  # page -> ids written, slot by slot
    running: list[_Req] = []
    waiting: list[_Req] = []
    hits = 0

    def write(req: _Req, start: int) -> None:
        for pos in range(start, len(req.ids)):
            page = req.pages[pos // PS]
            assert not pool.is_cached(page) and pool.refcount(page) == 1, "writing into a shared page"
            shadow[page][pos % PS] = req.ids[pos]

    def take(count: int):
        got = pool.allocate(count)
        for page in got or []:
            shadow[page] = [None] * PS
        return got

    def as_given(ids: list[int]):
        return ids if rng.random() < 0.5 else np.array(ids, rng.choice([np.int32, np.int64]))

    def admit(req: _Req) -> bool:
        nonlocal hits
        hit = pool.lookup(as_given(req.ids))
        assert len(hit.pages) <= (len(req.ids) - 1) // PS and hit.num_tokens == len(hit.pages) * PS
        for j, page in enumerate(hit.pages):
            assert shadow[page] == req.ids[j * PS:(j + 1) * PS], "a hit on the wrong ids"
        new = take(pool.pages_for(len(req.ids)) - len(hit.pages))
        if new is None:
            pool.cancel_lookup(hit)
            return False
        hits += len(hit.pages)
        req.pages, req.cursor = hit.pages + new, hit.cursor
        write(req, hit.num_tokens)
        pool.commit(req.cursor, req.pages, as_given(req.ids), len(req.ids))
        running.append(req)
        return True

    for step in range(1500):
        op = rng.random()
        if op < 0.3 or not running:
            if waiting and rng.random() < 0.5:
                req = waiting.pop(0)
            else:
                base = rng.choice(bases)
                req = _Req(base[:rng.randrange(len(base) + 1)] + tokens(rng.randrange(1, 6), rng.random(), 3))
            if not admit(req):
                waiting.append(req)
                if running:  # preempt the newest to make room
                    victim = running.pop()
                    pool.free(victim.pages)
                    waiting.append(victim)
        elif op < 0.8:
            req = rng.choice(running)
            req.ids.append(rng.randrange(3))
            if pool.pages_for(len(req.ids)) > len(req.pages):
                page = take(1)
                if page is None:
                    running.remove(req)
                    pool.free(req.pages)
                    req.ids.pop()
                    waiting.append(req)
                    pool.check()
                    continue
                req.pages += page
            write(req, len(req.ids) - 1)
            pool.commit(req.cursor, req.pages, as_given(req.ids), len(req.ids))
        elif op < 0.95:
            req = running.pop(rng.randrange(len(running)))
            pool.free(req.pages)
            if len(req.ids) < 40 and rng.random() < 0.3:
                waiting.append(req)  # preempted: resumed later by recomputation
        elif op < 0.99:
            probe = rng.choice(bases)[:rng.randrange(25)]
            hit = pool.lookup(probe)
            for j, page in enumerate(hit.pages):
                assert shadow[page] == probe[j * PS:(j + 1) * PS]
            pool.cancel_lookup(hit)
        else:
            pool.reset_prefix_cache()
        pool.check()
        expected = Counter(p for r in running for p in r.pages)
        assert all(pool.refcount(p) == expected[p] for p in range(1, pool.num_pages + 1))

    assert hits > 0  # the workload did share prefixes
    for req in running:
        pool.free(req.pages)
    pool.check()
    assert pool.num_free == pool.num_pages and pool.num_used == 0
