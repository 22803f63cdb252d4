"""The parent's KV page pool: pages taken on demand, reference-counted, with prefix caching.

Pure bookkeeping, no IO. Page ids run 1..num_pages; page 0 is the device's scratch page and is
never handed out. A page holds `page_size` tokens' K/V.

Every page is in exactly one of three states:

- free: no reference, no cached content; on the free list;
- used: referenced by one or more requests (`refcount > 0`), cached or not;
- evictable: no reference, but its content is cached; on an LRU list, oldest first.

`allocate` takes free pages first and evicts the least recently used cached pages only when the
free list runs short. `free` drops one reference from each page; a page left without references
goes back to the free list, or, when its content is cached, to the young end of the LRU list.

Prefix caching. A FULL page is identified by a hash chain: `hash_page(parent's hash, the page's
token ids)`, the first page's parent being `ROOT_HASH`. A request tells the pool which of its
pages are full and written with `commit`; another request whose token ids start the same way
gets those pages back from `lookup`, shares them (refcount 2, 3, ...) and prefills only the rest.
A hash is never trusted on its own: every cached page keeps its token ids and the identity of
the exact cached page it follows (a serial number given at commit, never reused), and a lookup
takes a page only when both match. Two different prefixes whose hashes collide, at any depth of
the chain, therefore never share K/V; a collision only costs a cache miss.

Typical use by a scheduler (one pool per worker, one step loop, no locking):

    # Admission; ids = the prompt, plus the tokens generated before a preemption.
    hit = pool.lookup(ids)
    new = pool.allocate(pool.pages_for(first_chunk_end) - len(hit.pages))
    if new is None:
        pool.cancel_lookup(hit)                # waits: nothing held, nothing counted
    else:
        req.pages = hit.pages + new            # block table; compute from hit.num_tokens on
        req.cursor = hit.cursor

    # A row growing past its last page (a decode step, the next prefill chunk):
    more = pool.allocate(pool.pages_for(end) - len(req.pages))
    while more is None:                        # dry: preempt the newest running request
        pool.free(victim.pages); requeue(victim); more = pool.allocate(...)

    # Each step, once the first n tokens have final ids and their K/V is written by a command
    # already sent (commands run in order, so any later command may read them):
    pool.commit(req.cursor, req.pages, ids, n)  # O(1) unless a page became full

    pool.free(req.pages)                       # finish or preemption; cached pages stay cached
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count
from typing import Iterator, NamedTuple, Sequence, Union

import numpy as np

from l3worker.engine.host_tier import HostTier

TokenIds = Union[Sequence[int], np.ndarray]

ROOT_HASH = 0x6C33_776F_726B_6572  # the parent hash of every request's first page


def hash_page(parent_hash: int, ids: bytes) -> int:
    """A full page's chain hash from its parent's hash and its token ids (native int32 bytes).

    Python's own hash: the pool lives in one process, and SipHash over the 512 bytes of a
    128-token page costs a fraction of a microsecond (hashlib's sha256 about three times more).
    Values differ between processes: a data-parallel router hashes prompts itself (chain_hashes)
    and only ever compares its own values.
    """
    return hash((parent_hash, ids))


def chain_hashes(token_ids: Sequence[int], page_size: int, max_pages: int | None = None) -> list[int]:
    """The chain hashes of the full pages that start `token_ids` (at most `max_pages`), as the
    pool of this process computes them: what a router keeps to guess which engine caches a prefix."""
    pack = struct.Struct(f"={page_size}i").pack
    stop = len(token_ids) // page_size if max_pages is None else min(max_pages, len(token_ids) // page_size)
    hashes, key = [], ROOT_HASH
    for s in range(0, stop * page_size, page_size):
        key = hash_page(key, pack(*token_ids[s:s + page_size]))
        hashes.append(key)
    return hashes


class _Entry(NamedTuple):
    """What a cached page is: its chain hash, its serial, its parent's serial, its token ids."""

    key: int
    serial: int
    parent: int  # serial of the cached page it follows; 0: the root
    ids: bytes


@dataclass(slots=True)
class CacheCursor:
    """Where one request's hash chain stands: its first `num_pages` pages are known to the pool
    (matched by `lookup` or registered by `commit`), the last of them with chain hash `hash`,
    cached as entry `serial` on page `page`. A request keeps it from admission to its end;
    `serial == -1` means the chain broke (a collision with a page in use, or its parent was
    evicted meanwhile) and none of the request's later pages will be cached."""

    num_pages: int = 0
    hash: int = ROOT_HASH
    serial: int = 0  # 0: the root
    page: int = 0  # 0: the root


@dataclass(slots=True)
class PrefixHit:
    """What `lookup` found: the leading cached pages (one reference taken on each), the tokens
    they cover (`len(pages) * page_size`), the cursor to continue the chain from, and the
    tokens the lookup counted as queried (so `cancel_lookup` can take them back)."""

    pages: list[int]
    num_tokens: int
    cursor: CacheCursor = field(default_factory=CacheCursor)
    queried: int = 0


class PagePool:
    """KV pages on demand with reference counts and an LRU-evicted prefix cache.

    Costs: `allocate`, `free` and `lookup` are O(pages touched); `commit` is O(pages newly
    registered) and O(1) when nothing new is full; nothing walks the pool except
    `reset_prefix_cache` (O(evictable pages)) and `check` (tests).
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True, host_pages: int = 0):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_pages, 0, -1))  # pops 1, 2, 3, ...
        self._ref = [0] * (num_pages + 1)
        self._entry: list[_Entry | None] = [None] * (num_pages + 1)
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently used first
        self._table: dict[int, int] = {}  # chain hash -> cached page
        self._serials = count(1)
        self._pack = struct.Struct(f"={page_size}i").pack
        # Prefix cache counters, in tokens (l3worker:prefix_cache_queries_total / _hits_total).
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evicted_pages = 0
        # KV events (l3worker/engine/kv_events.py), when a publisher listens: ("stored", hash,
        # parent hash or None, ids) / ("removed", hashes) / ("cleared",), taken after each step.
        self.events: list[tuple] | None = None
        # The second tier in host memory (l3worker/engine/host_tier.py): evicted entries go there.
        self.host = HostTier(host_pages) if host_pages and enable_prefix_caching else None

    # -- accounting --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one request."""
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached pages nobody references: kept until an allocation needs them."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages with a hash entry, used or evictable."""
        return len(self._table)

    @property
    def usage(self) -> float:
        """Fraction of the pages referenced."""
        return self.num_used / self.num_pages

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return self._entry[page] is not None

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # -- pages ---------------------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """`count` pages with one reference each, or None (and nothing taken) when free plus
        evictable pages fall short. Evicting a page drops its cached content."""
        free = self._free
        ref = self._ref
        if count < 0:
            raise ValueError(f"allocate({count})")
        if count <= len(free):
            if count == 1:  # the decode path: one row crossing a page boundary
                page = free.pop()
                ref[page] = 1
                return [page]
            out = free[len(free) - count:]
            del free[len(free) - count:]
            out.reverse()
        else:
            short = count - len(free)
            if short > len(self._lru):
                return None
            out = free[::-1]
            free.clear()
            lru, table, entry = self._lru, self._table, self._entry
            removed = []
            for _ in range(short):
                page, _ = lru.popitem(last=False)
                e = entry[page]
                del table[e.key]
                entry[page] = None
                out.append(page)
                if self.host is None:
                    removed.append(e.key)
                elif (dropped := self.host.store(e.key, e, page)) is not None:
                    removed.append(dropped)
            self.evicted_pages += short
            if self.events is not None:
                self.events.append(("removed", removed))
        for page in out:
            ref[page] = 1
        return out

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference from each page. Give a request's pages in block order: they are
        released last page first, so under pressure a cached prefix loses its tail before its
        head (a lookup needs the head to reach anything). Freeing a page with no reference is a
        scheduler bug and raises ValueError, leaving the pages before it already released."""
        ref, entry = self._ref, self._entry
        for page in reversed(pages):
            r = ref[page] - 1
            if r < 0 or page <= 0:
                raise ValueError(f"page {page} freed without a reference")
            ref[page] = r
            if r == 0:
                if entry[page] is None:
                    self._free.append(page)
                else:
                    self._lru[page] = None

    # -- prefix cache -------------------------------------------------------------------------------
    def lookup(self, token_ids: TokenIds, root: int = ROOT_HASH) -> PrefixHit:
        """The longest run of cached full pages that start `token_ids`, one reference taken on
        each (so none is evicted while the request uses it), and the tokens they cover.

        At most `(len(token_ids) - 1) // page_size` pages: the request always computes its last
        token, whose logits it needs, so a prompt of exactly k full pages gets at most k - 1.
        `token_ids` is a 1-D int32 (fastest) or other integer ndarray, or a sequence of ints.
        Counts `len(token_ids)` queried tokens and the covered tokens as hits. With prefix
        caching off, returns no pages and counts nothing. `root`: the chain's first parent hash
        (a LoRA adapter's own, so that its pages and the base model's never match)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, CacheCursor(hash=root))
        n = len(token_ids)
        ps = self.page_size
        table, entry, ref, lru = self._table, self._entry, self._ref, self._lru
        pages: list[int] = []
        key, serial, last = root, 0, 0
        for data in self._pages_of(token_ids, 0, max(n - 1, 0) // ps):
            k = hash_page(key, data)
            page = table.get(k)
            if page is None and (page := self._from_host(k, serial, data)) is None:
                break
            e = entry[page]
            if e.parent != serial or e.ids != data:
                break  # a hash collision: a different page or a different prefix
            if ref[page] == 0:
                del lru[page]
            ref[page] += 1
            pages.append(page)
            key, serial, last = k, e.serial, page
        hit = len(pages) * ps
        self.queries_tokens += n
        self.hits_tokens += hit
        return PrefixHit(pages, hit, CacheCursor(len(pages), key, serial, last), n)

    def _from_host(self, k: int, serial: int, data: bytes) -> int | None:
        """A device page for the host tier's entry `k` (continuing the chain at `serial`), its
        K/V to be copied back, cached and unused (lookup takes it); None when there is none."""
        e = self.host.find(k) if self.host is not None else None
        if e is None or e.parent != serial or e.ids != data:
            return None
        slot, _ = self.host.take(k)
        got = self.allocate(1)  # may push another evicted page to the host
        if got is None:
            self.host.put_back(k, slot, e)
            return None
        page = got[0]
        self.host.load(slot, page)
        self._entry[page], self._table[k] = e, page
        self._ref[page] = 0
        self._lru[page] = None  # as a cached page nobody uses: lookup takes its reference
        return page

    def take_copies(self) -> np.ndarray | None:
        """The host tier's copies to send before the next command (None: no tier, or none)."""
        if self.host is None:
            return None
        copies = self.host.take_copies()
        return copies if len(copies) else None

    def cancel_lookup(self, hit: PrefixHit) -> None:
        """Undoes a lookup whose request was not admitted after all (no pages for the rest):
        frees its pages and takes its tokens back out of the counters, so a request that waits
        through many steps is counted once, when it is admitted."""
        self.free(hit.pages)
        self.queries_tokens -= hit.queried
        self.hits_tokens -= hit.num_tokens
        hit.pages, hit.num_tokens, hit.queried = [], 0, 0

    def commit(self, cursor: CacheCursor, pages: Sequence[int], token_ids: TokenIds, num_tokens: int) -> int:
        """Registers as cached the request's full pages among its first `num_tokens` tokens that
        the cursor has not covered yet, and advances the cursor; returns how many pages it
        registered. `pages` is the request's block list (pages[i] holds tokens
        [i * page_size, (i + 1) * page_size)) and `token_ids` its ids, at least `num_tokens` of
        them. Call it once those tokens' ids are final and their K/V is written by a command
        already sent; a registered page must never be written again.

        A page whose content is already cached elsewhere (two requests prefilled the same prefix
        together) is not registered while the cached copy is in use: it stays private, is freed
        straight to the free list, and the chain continues through the copy; an unused copy is
        freed instead and this page takes its entry over. A hash taken by a different page that
        nobody uses is taken over; one taken by a page in use breaks the request's chain."""
        full = num_tokens // self.page_size
        i = cursor.num_pages
        if full <= i:
            return 0
        if full > len(pages) or num_tokens > len(token_ids):
            raise ValueError(f"commit of {num_tokens} tokens with {len(pages)} pages and {len(token_ids)} ids")
        cursor.num_pages = full
        if not self.enable_prefix_caching or cursor.serial < 0:
            return 0
        table, entry, ref = self._table, self._entry, self._ref
        key, serial, last = cursor.hash, cursor.serial, cursor.page
        if last and (entry[last] is None or entry[last].serial != serial):
            cursor.serial = -1  # the parent was evicted meanwhile: what follows cannot be found
            return 0
        registered = 0
        for page, data in zip(pages[i:full], self._pages_of(token_ids, i, full)):
            if ref[page] <= 0:
                raise ValueError(f"page {page} committed without a reference")
            k = hash_page(key, data)
            other = table.get(k)
            if other is not None:
                e = entry[other]
                if e.parent == serial and e.ids == data:  # already cached (possibly this page)
                    if other != page and not ref[other] and entry[page] is None:
                        # The cached copy is unused: this page takes its entry over, serial and
                        # all (its cached children stay reachable), and the copy is freed.
                        del self._lru[other]
                        entry[other] = None
                        self._free.append(other)
                        entry[page] = e
                        table[k] = other = page
                        registered += 1
                    key, serial, last = k, e.serial, other
                    continue
                if ref[other]:
                    cursor.serial = -1  # taken by a page in use
                    break
            if entry[page] is not None:
                raise ValueError(f"page {page} is already cached with other contents")
            if other is not None:
                del self._lru[other]  # evictable: a colliding or orphaned entry gives way
                del table[k]
                entry[other] = None
                self._free.append(other)
                if self.events is not None:
                    self.events.append(("removed", [k]))
            serial_new = next(self._serials)
            entry[page] = _Entry(k, serial_new, serial, data)
            table[k] = page
            if self.events is not None:
                self.events.append(("stored", k, key if last else None, data))
            key, serial, last = k, serial_new, page
            registered += 1
        else:
            cursor.hash, cursor.serial, cursor.page = key, serial, last
        return registered

    def reset_prefix_cache(self, in_use: bool = False) -> int:
        """Forgets every evictable cached page (they become free); pages in use keep their
        entries until freed, or with `in_use` (new weights: no page's K/V may be found again)
        lose them now and go to the free list when their requests end. Returns how many cached
        pages were dropped."""
        entry, table = self._entry, self._table
        removed = []
        for page in self._lru:
            removed.append(entry[page].key)
            del table[removed[-1]]
            entry[page] = None
            self._free.append(page)
        self._lru.clear()
        if in_use:
            for page, e in enumerate(entry):
                if e is not None:
                    removed.append(e.key)
                    del table[e.key]
                    entry[page] = None
        if self.host is not None:
            removed += self.host.clear()
        if self.events is not None and removed:
            self.events.append(("cleared",) if not table else ("removed", removed))
        return len(removed)

    # -- internals ------------------------------------------------------------------------------------
    def _pages_of(self, token_ids: TokenIds, first: int, stop: int) -> Iterator[bytes]:
        """Pages first..stop-1 of `token_ids`, each as native int32 bytes: the same bytes for a
        list and an ndarray of the same ids. A sequence is converted page by page as the caller
        goes (a lookup stops at its first miss); an ndarray's first page alone, then the rest in
        one copy."""
        ps = self.page_size
        if isinstance(token_ids, np.ndarray):
            ids = token_ids[first * ps:stop * ps]
            if ids.dtype != np.int32:
                ids = ids.astype(np.int32)
            if len(ids):
                yield ids[:ps].tobytes()
                buf, nb = ids[ps:].tobytes(), 4 * ps
                yield from (buf[o:o + nb] for o in range(0, len(buf), nb))
        else:
            pack = self._pack
            yield from (pack(*token_ids[s:s + ps]) for s in range(first * ps, stop * ps, ps))

    def check(self) -> None:
        """Asserts the pool's invariants (tests; O(pool)): every page is exactly one of free,
        used or evictable; refcounts are >= 0; cached pages and hash entries agree."""
        n = self.num_pages
        free, lru, ref, entry, table = self._free, self._lru, self._ref, self._entry, self._table
        assert ref[0] == 0 and entry[0] is None, "page 0 is never handed out"
        assert len(set(free)) == len(free), "a page twice on the free list"
        state = {}
        for page in free:
            assert 1 <= page <= n, f"page {page} out of range"
            assert ref[page] == 0 and entry[page] is None, f"free page {page} referenced or cached"
            state[page] = "free"
        for page in lru:
            assert page not in state, f"page {page} free and evictable"
            assert ref[page] == 0 and entry[page] is not None, f"evictable page {page} referenced or uncached"
            state[page] = "evictable"
        for page in range(1, n + 1):
            assert ref[page] >= 0, f"page {page} refcount {ref[page]}"
            if ref[page] > 0:
                assert page not in state, f"page {page} used and {state.get(page)}"
                state[page] = "used"
        assert len(state) == n, f"{n - len(state)} pages in no state"
        assert len(free) + len(lru) + sum(1 for p in range(1, n + 1) if ref[p] > 0) == n
        cached = [p for p in range(1, n + 1) if entry[p] is not None]
        assert len(cached) == len(table), "cached pages and hash entries disagree"
        for page in cached:
            assert table.get(entry[page].key) == page, f"page {page}'s hash entry points elsewhere"
        if not self.enable_prefix_caching:
            assert not table and not lru, "prefix caching off but pages cached"
