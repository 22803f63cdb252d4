"""The router following KV events over ZeroMQ (l3worker/distributed/kv_event_feed.py): batches a
real publisher sends from a page pool's records reach the router, which then holds exactly the
pool's cached prefixes; a lost batch is counted."""
from __future__ import annotations

import asyncio

import numpy as np
import zmq.asyncio

from l3worker.distributed.kv_event_feed import KVEventFeed, subscriber_endpoints
from l3worker.distributed.router import Router, RouterConfig
from l3worker.engine.kv_events import KVEventPublisher, KVEventsConfig
from l3worker.engine.page_pool import PagePool, chain_hashes

PS = 4


def test_subscribers_reach_each_ranks_port_on_this_machine() -> None:
    assert subscriber_endpoints("tcp://*:5557", 3) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558",
                                                       "tcp://127.0.0.1:5559")
    assert subscriber_endpoints("tcp://10.0.0.2:6000", 2) == ("tcp://10.0.0.2:6000", "tcp://10.0.0.2:6001")


def commit(pool: PagePool, ids: np.ndarray) -> None:
    hit = pool.lookup(ids)
    pages = pool.allocate(len(ids) // PS - len(hit.pages))
    pool.commit(hit.cursor, hit.pages + pages, ids, len(ids))
    pool.free(hit.pages + pages)


def with_feed(body, silent: tuple[str, ...] = ()) -> None:
    """Runs `await body(publisher, feed, router, ctx)`: a real publisher as the last engine, the
    `silent` endpoints (which publish nothing) as the engines before it, and a feed following all."""
    async def run() -> None:
        publisher = KVEventPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:0"), PS)
        ctx = zmq.asyncio.Context()
        router = Router(RouterConfig(len(silent) + 1, PS, 100, events_endpoints=(*silent, publisher.endpoint)))
        feed = KVEventFeed(ctx, router)
        tasks = feed.tasks()
        try:
            await body(publisher, feed, router, ctx)
        finally:
            for task in tasks:
                task.cancel()
            ctx.destroy(linger=0)
            publisher.close()

    asyncio.run(run())


def test_the_router_holds_what_the_publishing_pool_holds(tmp_path) -> None:
    async def body(publisher, feed, router, ctx) -> None:
        pool = PagePool(6, PS)
        pool.events = []
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 50, PS * 2).astype(np.int32) for _ in range(6)]
        assert await feed.subscribed(0.3) is False  # engine 0 never answers
        await asyncio.sleep(0.3)  # the subscription follows engine 1's handshake closely
        for k, ids in enumerate(prompts):
            commit(pool, ids)
            if k == 3:
                publisher._seq += 1  # a batch lost on the way
            publisher.publish(pool.events)
            pool.events = []
        for _ in range(100):
            if feed.events >= 1 and router.pages[1] and feed._next_seq[1] == publisher._seq:
                break
            await asyncio.sleep(0.02)
        held = {k for k, ids in enumerate(prompts) if router.matched_pages(1, chain_hashes(ids.tolist(), PS)) == 2}
        in_pool = {k for k, ids in enumerate(prompts) if pool.lookup(ids).pages}
        assert pool.evicted_pages > 0 and held == in_pool and not router.pages[0]
        assert feed.missed_batches == 1

    with_feed(body, silent=(f"ipc://{tmp_path}/engine-0",))  # engine 0 publishes nothing


def test_subscribed_waits_for_the_publisher_and_batches_before_the_first_received_count_as_lost(tmp_path) -> None:
    """`subscribed()` is True once the SUB socket has shaken hands with the engine's publisher, and
    False after its timeout where no publisher answers. Batches the engine published before the
    first one the router received are counted as lost, not silently skipped."""
    async def body(publisher, feed, router, ctx) -> None:
        assert await feed.subscribed(30.0)
        publisher._seq += 3  # three batches that went out before this router listened
        pool = PagePool(6, PS)
        for k in range(500):  # until one arrives: the subscription follows the handshake closely
            pool.events = []
            commit(pool, np.arange(1 + k, 1 + k + 2 * PS, dtype=np.int32))
            publisher.publish(pool.events)
            await asyncio.sleep(0.01)
            if feed.events:
                break
        # Every batch before the first received counts as lost: the three sent before the router
        # listened, and any sent during the handshake. More than one may have arrived by now (the
        # loop's last wait can take two), so the count stops below the last one received.
        last = feed._next_seq[0] - 1
        assert 3 <= feed.missed_batches <= last
        silent = KVEventFeed(ctx, Router(RouterConfig(1, PS, 100, events_endpoints=(f"ipc://{tmp_path}/none",))))
        assert not await silent.subscribed(0.2)

    with_feed(body)
