"""KV cache events as vLLM publishes them (`--kv-events-config`), so that an external KV-aware
router (llm-d, NVIDIA Dynamo, ...) can follow each engine's prefix cache.

The page pool records what it stores and evicts (PagePool.events); after each step the engine
hands the records here, and one batch goes out on a ZeroMQ PUB socket as three frames: the topic,
the batch's sequence number (8 bytes, big-endian) and the batch in vLLM's msgpack shape,
`[ts, [event, ...]]` (plus the data-parallel rank when there is one), each event an array led by
its type's name:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A block's hash is the pool's chain hash (an int, meaningful only within one engine's run). A
subscriber that misses sequence numbers asks the replay socket (ROUTER, optional) for them: it
sends the first missing number and gets `[seq, batch]` frames for every buffered batch from
there, then `[seq, b""]`.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from chip_child.config import config_fields

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys; a key it does not know is a ValueError naming it."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # accepted: batches are sent from the loop, never queued
    topic: str = ""

    @classmethod
    def of(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """None unless events are on."""
        if value is None or isinstance(value, KVEventsConfig):
            return value if value is None or value.enable_kv_cache_events else None
        config = cls(**config_fields(value, cls, "kv_events_config"))
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be an int >= 1, got {getattr(config, name)!r}")
        return config if config.enable_kv_cache_events else None


def offset_port(endpoint: str, offset: int) -> str:
    """tcp://host:PORT with PORT + offset (one data-parallel rank's endpoint, as vLLM offsets them)."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + offset}"


def encode_events(records: list[tuple], page_size: int) -> list[list[Any]]:
    """The pool's records as vLLM's event arrays; consecutive stores of one chain merge."""
    import numpy as np  # here: the serve command's parser imports this module

    events: list[list[Any]] = []
    for record in records:
        kind = record[0]
        if kind == "stored":
            _, key, parent, ids = record
            last = events[-1] if events else None
            if last is not None and last[0] == "BlockStored" and last[1][-1] == parent:
                last[1].append(key)
                last[3].extend(np.frombuffer(ids, np.int32).tolist())
                continue
            events.append(["BlockStored", [key], parent, np.frombuffer(ids, np.int32).tolist(), page_size, None, None])
        elif kind == "removed":
            events.append(["BlockRemoved", list(record[1]), None])
        else:
            events.append(["AllBlocksCleared"])
    return events


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, page_size: int, data_parallel_rank: int | None = None):
        self.config, self.page_size, self.rank = config, page_size, data_parallel_rank
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # the buffer: appended by the loop, read by the replay thread
        self._ctx = zmq.Context() if config.publisher == "zmq" else None
        self._pub = self._replay = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._ctx is not None:
            offset = data_parallel_rank or 0
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(offset_port(config.endpoint, offset))
            if config.replay_endpoint:  # answered by a thread: an idle engine steps no loop
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(offset_port(config.replay_endpoint, offset))
                self._thread = threading.Thread(target=self._serve_replays, name="l3worker-kv-replay", daemon=True)
                self._thread.start()

    @property
    def endpoint(self) -> str | None:
        """Where the PUB socket listens (the port a `:0` bind was given, resolved)."""
        return None if self._pub is None else self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish_pool(self, pool) -> None:
        """What the page pool stored and evicted since the last call, as one batch."""
        records, pool.events = pool.events, []
        self.publish(records)

    def publish(self, records: list[tuple]) -> None:
        """One batch of the pool's records (none: nothing is sent)."""
        if not records or self._pub is None:
            return
        batch: list[Any] = [time.time(), encode_events(records, self.page_size)]
        if self.rank is not None:
            batch.append(self.rank)
        payload = msgpack.packb(batch)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: the batch stays in the replay buffer
            pass

    def _serve_replays(self) -> None:
        replay = self._replay
        while not self._stop.is_set():
            if not replay.poll(100):
                continue
            who, *frames = replay.recv_multipart()
            start = int.from_bytes(frames[-1], "big") if frames else 0
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in batches:
                replay.send_multipart([who, b"", seq.to_bytes(8, "big"), payload])
            replay.send_multipart([who, b"", (-1).to_bytes(8, "big", signed=True), b""])  # the end

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = self._pub = self._replay = None
