"""Which data-parallel engine core serves a request (`--data-parallel-routing`). Pure bookkeeping.

- round_robin: engines in turn.
- least_loaded: the engine with the fewest requests in flight (waiting + running, as this router
  knows them: sent there and not finished yet); ties in turn.
- cache_aware (default): the router remembers, per engine, the chain hashes of the prompt pages
  it sent there (the page pool's own hash chain, l3worker.engine.page_pool.chain_hashes), as an LRU set
  no larger than that engine's KV pool, so what the engine has long evicted ages out here too.
  A request goes to the engine holding the longest run of its leading pages, unless that engine's
  load exceeds the least loaded one's by more than `load_margin`; then, and for a prefix no engine
  holds, to the least loaded, ties broken toward the engine holding fewer pages, so new prefixes
  spread over the engines even when requests come one at a time.

The set is an approximation: an engine may have evicted a page the router still lists (a miss
costs a prefill, never a wrong answer: the pool checks token ids), and each API server keeps its
own router, seeing only its own requests. When the engines publish KV events
(`--kv-events-config`, every rank on this node), each router also follows them
(l3worker/distributed/kv_event_feed.py): pages an engine stored for any API server's requests are
added, pages it evicted are dropped. The events carry the engine's hashes, which differ from this
process's, so the router hashes each stored page's token ids itself and maps one to the other.
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from l3worker.engine.page_pool import ROOT_HASH, chain_hashes, hash_page

ROUTINGS = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    num_engines: int
    page_size: int
    capacity_pages: int  # per engine: its KV pool's pages
    policy: str = "cache_aware"
    load_margin: int = 4  # requests in flight the best-matching engine may have over the least loaded
    events_endpoints: tuple[str, ...] = ()  # per engine, where its KV events are published; (): none

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ValueError(f"data-parallel routing must be one of {ROUTINGS}, got {self.policy!r}")
        if self.num_engines < 1 or self.page_size < 1 or self.capacity_pages < 1 or self.load_margin < 0:
            raise ValueError(f"bad router configuration {self}")


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.load = [0] * config.num_engines
        self.pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(config.num_engines)]
        self.down: set[int] = set()  # engines lost (a remote node gone): never chosen again
        self._turn = 0
        # From KV events: per engine, its hash of each page it stores -> this process's hash.
        self._ours: list[dict[int, int]] = [{} for _ in range(config.num_engines)]

    def choose(self, prompt: Sequence[int]) -> int:
        """The engine for a request with these prompt ids, among those not down (the caller stops
        serving once all are); counts it in flight there (call `finished` when it ends)."""
        policy = self.config.policy
        up = [e for e in range(self.config.num_engines) if e not in self.down] or list(range(self.config.num_engines))
        if policy == "round_robin":
            engine = self._next_turn(up)
        elif policy == "least_loaded":
            least = min(self.load[e] for e in up)
            engine = self._next_turn([e for e in up if self.load[e] == least])
        else:
            # The pool never shares a prompt's last token's page (see PagePool.lookup).
            hashes = chain_hashes(prompt, self.config.page_size, max(len(prompt) - 1, 0) // self.config.page_size)
            engine = self._cache_aware(hashes, up)
            self._remember(engine, hashes)
        self.load[engine] += 1
        return engine

    def finished(self, engine: int) -> None:
        self.load[engine] -= 1

    def matched_pages(self, engine: int, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's chain) the router believes `engine` holds, from the first."""
        held = self.pages[engine]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _cache_aware(self, hashes: list[int], engines: list[int]) -> int:
        least = min(self.load[e] for e in engines)
        matched = {e: self.matched_pages(e, hashes) for e in engines}
        best = max(engines, key=lambda e: (matched[e], -self.load[e], -len(self.pages[e]), -e))
        if matched[best] > 0 and self.load[best] - least <= self.config.load_margin:
            return best
        return min((e for e in engines if self.load[e] == least), key=lambda e: (len(self.pages[e]), e))

    def _remember(self, engine: int, hashes: list[int]) -> None:
        """The request's pages become the engine's youngest; the oldest beyond its pool's size age out."""
        held = self.pages[engine]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.config.capacity_pages:
            held.popitem(last=False)

    # -- KV events (what the engines really hold) --------------------------------------------------
    def stored(self, engine: int, parent: int | None, block_hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """A BlockStored event: full pages chained after `parent` (the engine's hash; None: the
        first page). A chain whose parent this router never saw stored is skipped."""
        ours = self._ours[engine]
        key = ROOT_HASH if parent is None else ours.get(parent)
        if key is None:
            return
        size = self.config.page_size
        pack = struct.Struct(f"={size}i").pack
        pages = []
        for i, block in enumerate(block_hashes):
            ids = token_ids[i * size:(i + 1) * size]
            if len(ids) < size:
                break
            key = ours[block] = hash_page(key, pack(*ids))
            pages.append(key)
        self._remember(engine, pages)

    def removed(self, engine: int, block_hashes: Sequence[int]) -> None:
        """A BlockRemoved event: the engine evicted these pages."""
        ours, held = self._ours[engine], self.pages[engine]
        for block in block_hashes:
            key = ours.pop(block, None)
            if key is not None:
                held.pop(key, None)

    def cleared(self, engine: int) -> None:
        """AllBlocksCleared: the engine's prefix cache was reset."""
        self._ours[engine].clear()
        self.pages[engine].clear()

    def _next_turn(self, candidates: Sequence[int]) -> int:
        """The first candidate at or after the rotating turn."""
        n = self.config.num_engines
        for k in range(n):
            e = (self._turn + k) % n
            if e in candidates:
                self._turn = (e + 1) % n
                return e
        raise AssertionError("no candidate engine")
