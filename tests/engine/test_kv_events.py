"""KV events in vLLM's shape: what the page pool stores and evicts, published after each step
over ZeroMQ, and replayed on request. A subscriber that applies the events must end up with
exactly the pool's own cached blocks."""
from __future__ import annotations


import msgpack
import numpy as np
import pytest
import zmq

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams
from l3worker.engine.kv_events import KVEventsConfig, encode_events
from l3worker.engine.page_pool import PagePool


def apply(events: list, cached: dict) -> None:
    """A subscriber's view: block hash -> its token ids."""
    for event in events:
        if event[0] == "BlockStored":
            _, hashes, parent, ids, size, lora, medium = event
            assert parent is None or parent in cached, "a stored chain must continue a cached block"
            for i, h in enumerate(hashes):
                cached[h] = ids[i * size:(i + 1) * size]
        elif event[0] == "BlockRemoved":
            for h in event[1]:
                del cached[h]
        else:
            assert event == ["AllBlocksCleared"]
            cached.clear()


@pytest.mark.parametrize("host_pages", [0, 3])
def test_the_pools_records_replayed_give_its_own_cache(host_pages: int) -> None:
    """With a host tier, a page moved there is still cached (no event); it is removed when it
    leaves both tiers."""
    pool = PagePool(6, 4, host_pages=host_pages)
    pool.events = []
    cached: dict = {}
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = rng.integers(0, 5, 4 * int(rng.integers(1, 4))).astype(np.int32)
        hit = pool.lookup(ids)
        pages = pool.allocate(len(ids) // 4 - len(hit.pages))
        if pages is None:
            pool.cancel_lookup(hit)
            continue
        pool.commit(hit.cursor, hit.pages + pages, ids, len(ids))
        pool.free(hit.pages + pages)
        apply(encode_events(pool.events, 4), cached)
        pool.events = []
        pool.take_copies()
        assert set(cached) == set(pool._table) | set(pool.host._held if pool.host else ())
    assert pool.evicted_pages > 0
    pool.reset_prefix_cache()
    apply(encode_events(pool.events, 4), cached)
    assert cached == {} and pool._table == {}


def test_a_worker_publishes_every_store_and_eviction_and_replays_them(make_checkpoint) -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    shared = list(range(1, 17))
    prompts = [shared + [100 + i] + list(range(20, 35)) for i in range(6)]  # 2 shared pages, 2 own each
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ctx = zmq.Context()
    with guard(), DistributedWorker(str(make_checkpoint()), device="cpu", max_batch_size=2, max_seq_len=64,
                                    page_size=8, num_pages=12, num_threads=1, kv_events_config=config) as w:
        w.prepare()
        sub = ctx.socket(zmq.SUB)
        sub.connect(w.engine.kv_events.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        # A PUB socket drops what it sends before a subscription reaches it: prompts until one
        # batch arrives (each stores a page), then the live stream is complete.
        for i in range(100):
            w.generate([[200 + i] * 8], params)
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        for p in prompts:
            w.generate([p], params)
        live = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            live.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        req = ctx.socket(zmq.DEALER)  # a REQ socket's frames, and every reply read
        req.connect(w.engine.kv_events.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while req.poll(5000):
            _, seq, payload = req.recv_multipart()
            if not payload:
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        pool = w.engine.scheduler.pages
        cached: dict = {}
        for _, (ts, events) in replayed:
            apply(events, cached)
        assert set(cached) == set(pool._table)
        assert {h: bytes(np.array(ids, np.int32)) for h, ids in cached.items()} == \
            {k: pool._entry[p].ids for k, p in pool._table.items()}
        removed = sum(len(e[1]) for _, (_, events) in replayed for e in events if e[0] == "BlockRemoved")
        assert removed == pool.evicted_pages > 0
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert len(live) >= len(prompts) and live == replayed[-len(live):]
        ctx.destroy(linger=0)
    assert w.engine.kv_events is None  # closed with the worker


def test_the_config_is_checked_by_name() -> None:
    assert KVEventsConfig.of(None) is None and KVEventsConfig.of({"publisher": "zmq"}) is None  # off
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['endpiont'\]"):
        KVEventsConfig.of({"enable_kv_cache_events": True, "endpiont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.of('{"enable_kv_cache_events": true, "publisher": "nats"}')
