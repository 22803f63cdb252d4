"""The data-parallel router's decisions (l3worker/distributed/router.py), without any process."""
from __future__ import annotations

import pytest

from l3worker.engine.page_pool import PagePool, chain_hashes
from l3worker.distributed.router import Router, RouterConfig

PS = 4


def prompt(prefix: int, pages: int, tail: int = 1) -> list[int]:
    """`pages` full pages that identify `prefix`, then `tail` more tokens."""
    return [prefix * 1000 + k for k in range(pages * PS)] + [7] * tail


def router(policy: str = "cache_aware", engines: int = 2, capacity: int = 100, margin: int = 2) -> Router:
    return Router(RouterConfig(engines, PS, capacity, policy, margin))


def test_the_router_hashes_pages_as_the_page_pool_does() -> None:
    ids = prompt(3, 3)
    pool = PagePool(8, PS)
    hit = pool.lookup(ids)
    pages = pool.allocate(pool.pages_for(len(ids)))
    pool.commit(hit.cursor, pages, ids, len(ids))
    assert pool._entry[pages[2]].key == chain_hashes(ids, PS)[2]  # the same chain, page for page
    assert len(chain_hashes(ids, PS)) == 3 and len(chain_hashes(ids, PS, 2)) == 2


def test_a_request_goes_to_the_engine_with_the_longest_match() -> None:
    r = router()
    assert r.choose(prompt(1, 1)) == 0  # new prefixes spread: 0, then the engine holding fewer pages
    assert r.choose(prompt(2, 3)) == 1  # engine 0 is busier
    r.finished(0), r.finished(1)
    # Engine 1 holds all of prefix 2's pages, engine 0 none of them.
    assert r.choose(prompt(2, 3, tail=5)) == 1
    r.finished(1)
    longer = prompt(1, 1)[:PS] + prompt(2, 2)[PS:]  # prefix 1's first page, then other pages
    assert r.choose(longer) == 0  # one matching page on engine 0, none on engine 1


def test_new_prefixes_go_to_the_least_loaded_ties_toward_fewer_cached_pages() -> None:
    r = router(engines=3)
    assert r.choose(prompt(1, 4)) == 0  # engine 0 now holds 4 pages, busy
    assert r.choose(prompt(2, 2)) == 1  # least loaded: 1 and 2 tie at 0 pages -> lower index
    r.finished(0), r.finished(1)
    # All idle: engine 2 holds nothing, engine 1 two pages, engine 0 four.
    assert r.choose(prompt(3, 1)) == 2
    assert r.choose(prompt(4, 1)) == 1  # engine 2 is now busier than 0 and 1; 1 holds fewer pages
    assert r.load == [0, 1, 1]
    assert r.choose(prompt(5, 1)) == 0  # the only idle engine, though it holds the most pages


def test_a_busy_best_match_loses_to_the_least_loaded_beyond_the_margin() -> None:
    r = router(margin=2)
    shared = prompt(1, 2)
    assert r.choose(shared) == 0
    assert r.choose(prompt(9, 1)) == 1
    r.finished(1)  # engine 0: 1 in flight, engine 1: 0
    assert r.choose(shared) == 0  # 2 in flight there vs 0: within the margin
    assert r.choose(shared) == 0  # 3 vs 0 afterwards; at choice time 2 - 0 <= 2
    assert r.load == [3, 0]
    assert r.choose(shared) == 1  # 3 - 0 > 2: the least loaded takes it, and now holds it too
    assert r.matched_pages(1, chain_hashes(shared, PS, 1)) == 1


def test_pages_age_out_least_recently_sent_first() -> None:
    r = router(engines=1, capacity=4)
    a, b, c = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    r.choose(a), r.choose(b)
    r.choose(a)  # a is now younger than b
    r.choose(c)  # 6 pages > 4: b's two pages go
    held = lambda ids: r.matched_pages(0, chain_hashes(ids, PS))  # noqa: E731
    assert (held(a), held(b), held(c)) == (2, 0, 2)


def test_round_robin_and_least_loaded_ignore_prefixes() -> None:
    rr = router("round_robin", engines=3)
    assert [rr.choose(prompt(1, 2)) for _ in range(4)] == [0, 1, 2, 0]
    ll = router("least_loaded", engines=3)
    assert [ll.choose(prompt(1, 2)) for _ in range(3)] == [0, 1, 2]
    ll.finished(1)
    assert ll.choose(prompt(1, 2)) == 1
    assert not any(ll.pages) and not any(rr.pages)


def test_a_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="routing must be one of"):
        RouterConfig(2, PS, 10, "random")


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded", "round_robin"])
def test_an_engine_that_is_down_is_never_chosen(policy: str) -> None:
    r = router(policy, engines=3)
    held = prompt(4, 2)
    first = r.choose(held)
    r.finished(first)
    r.down.add(first)  # lost with the pages it held, however long a prefix of this prompt they are
    chosen = [r.choose(held if k % 2 else prompt(10 + k, 1)) for k in range(6)]
    assert first not in chosen and set(chosen) == {0, 1, 2} - {first}


# -- following the engines' KV events ------------------------------------------------------------------
def other_process_hashes(n: int, base: int) -> list[int]:
    """An engine's block hashes: its own process's values, unrelated to this one's."""
    return [base + k for k in range(n)]


def test_stored_pages_are_hashed_here_and_mapped_from_the_engines_hashes() -> None:
    r = router()
    ids = prompt(5, 3)
    engine_hashes = other_process_hashes(3, 900)
    r.stored(1, None, engine_hashes[:2], ids[:2 * PS])  # a chain in two events, as a step may send it
    r.stored(1, engine_hashes[1], engine_hashes[2:], ids[2 * PS:3 * PS])
    assert r.matched_pages(1, chain_hashes(ids, PS)) == 3 and r.matched_pages(0, chain_hashes(ids, PS)) == 0
    # a prefix stored for another API server's requests: this router never sent it, yet routes to it
    assert r.choose(ids) == 1
    r.removed(1, [engine_hashes[1]])  # evicted there (its child goes with it in a real pool)
    assert r.matched_pages(1, chain_hashes(ids, PS)) == 1
    r.stored(0, 12345, other_process_hashes(1, 50), ids[:PS])  # a parent never seen stored: skipped
    assert r.matched_pages(0, chain_hashes(ids, PS)) == 0
    r.cleared(1)
    assert r.matched_pages(1, chain_hashes(ids, PS)) == 0 and not r._ours[1]


def test_an_eviction_event_corrects_the_guess() -> None:
    """Without events the router believes engine 0 still holds a prefix it sent there; the event of
    its eviction sends the next request to the least loaded engine instead."""
    r = router(margin=4)
    ids = prompt(6, 2)
    assert r.choose(ids) == 0
    r.choose(prompt(7, 1))  # engine 1 now has one in flight, engine 0 one too
    r.finished(1)  # engine 0: 1 in flight, engine 1: 0
    engine_hashes = other_process_hashes(2, 700)
    r.stored(0, None, engine_hashes, ids[:2 * PS])
    assert r.choose(ids) == 0  # the match wins within the margin
    r.finished(0)
    r.removed(0, engine_hashes)
    assert r.choose(ids) == 1  # no engine holds it any more: the least loaded
