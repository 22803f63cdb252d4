"""The built-in router following the engines' KV events: one SUB socket per engine on the API
server's event loop, each batch applied to its Router as it comes (l3worker/engine/kv_events.py
says what an engine publishes; l3worker/distributed/router.py what the router does with it).

A batch lost on the way (a sequence number skipped) is counted and logged once: the router then
keeps its own guess for what that batch said, as it does without events. A PUB socket drops what
it sends before a subscription reaches it, so the API server waits (`subscribed`) until each SUB
socket has shaken hands with its engine's publisher before it serves; a batch that still goes
before the subscription (the handshake and the subscription are a moment apart) is counted.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, generate_latest

from l3worker.distributed.router import Router
from l3worker.engine.kv_events import offset_port

log = logging.getLogger("l3worker.router")
SUBSCRIBED_TIMEOUT_S = 10.0  # how long the API server waits for the subscriptions before serving anyway


def subscriber_endpoints(endpoint: str, num_engines: int) -> tuple[str, ...]:
    """Where a process on this node reaches each rank's publisher: rank r binds `endpoint` with
    its port offset by r (as vLLM offsets them); a wildcard host is this machine."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            endpoint = "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return tuple(offset_port(endpoint, rank) for rank in range(num_engines))


def apply_batch(router: Router, engine: int, payload: bytes) -> int:
    """One published batch, `[ts, events(, rank)]`, applied to the router; returns its event count."""
    events = msgpack.unpackb(payload)[1]
    for event in events:
        kind = event[0]
        if kind == "BlockStored":
            router.stored(engine, event[2], event[1], event[3])
        elif kind == "BlockRemoved":
            router.removed(engine, event[1])
        elif kind == "AllBlocksCleared":
            router.cleared(engine)
    return len(events)


@dataclass
class RouterMetrics:
    registry: CollectorRegistry
    events: Counter
    lost: Counter


def router_metrics() -> RouterMetrics:
    """The router's series (each API server's, labelled `api_server`), in a registry of their own."""
    r = CollectorRegistry()
    return RouterMetrics(r, Counter("l3worker:router_kv_events", "KV events the data-parallel router applied "
                                    "(--kv-events-config; per API server)", ["api_server"], registry=r),
                         Counter("l3worker:router_kv_event_batches_lost", "KV event batches lost on the way to "
                                 "the router (it guesses for those)", ["api_server"], registry=r))


class KVEventFeed:
    def __init__(self, ctx: zmq.asyncio.Context, router: Router, topic: str = ""):
        self.router = router
        self.events = 0  # applied
        self.missed_batches = 0  # sequence numbers skipped: the router guessed for those
        self._next_seq = [0] * router.config.num_engines  # an engine numbers its batches from 0
        self._subs, self._monitors = [], []
        for endpoint in router.config.events_endpoints:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            # The monitor goes on before the connect, so the handshake's event is not missed.
            self._monitors.append(sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            sub.connect(endpoint)
            self._subs.append(sub)

    async def subscribed(self, timeout_s: float = SUBSCRIBED_TIMEOUT_S) -> bool:
        """Waits until every SUB socket has shaken hands with its engine's publisher (the
        subscription goes out with the handshake, before any request's batch). False, with a
        warning, past `timeout_s`: the router then guesses for what it missed."""
        async def handshake(sub, monitor) -> None:
            try:
                await monitor.recv_multipart()  # the monitor reports only EVENT_HANDSHAKE_SUCCEEDED
            finally:
                sub.disable_monitor()
                monitor.close(0)

        pending = list(zip(self._subs, self._monitors))
        self._monitors = []
        try:
            await asyncio.wait_for(asyncio.gather(*(handshake(s, m) for s, m in pending)), timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("router: not subscribed to every engine's KV events after %.0f s; it guesses for what "
                        "it misses", timeout_s)
            return False

    def exposition(self, api_server: int) -> bytes:
        """This API server's router series, in Prometheus' text format."""
        metrics = router_metrics()
        metrics.events.labels(str(api_server)).inc(self.events)
        metrics.lost.labels(str(api_server)).inc(self.missed_batches)
        return generate_latest(metrics.registry)

    def tasks(self) -> list[asyncio.Task]:
        return [asyncio.ensure_future(self._follow(engine, sub)) for engine, sub in enumerate(self._subs)]

    async def _follow(self, engine: int, sub) -> None:
        while True:
            _topic, seq_bytes, payload = await sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            expected = self._next_seq[engine]  # batches before the first one received count as lost too
            if seq > expected:
                if not self.missed_batches:
                    log.warning("router: %d KV event batches of engine %d were lost; it guesses for them",
                                seq - expected, engine)
                self.missed_batches += seq - expected
            self._next_seq[engine] = seq + 1
            self.events += apply_batch(self.router, engine, payload)
