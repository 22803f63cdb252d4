"""The periodic throughput line vLLM logs unless --disable-log-stats: prompt and generation
tokens per second since the last line, the requests running and waiting, the KV cache's use and
the prefix cache's hit rate. Read from the engine's own /metrics series (every engine core's, with
data parallelism), so the server counts nothing itself. An idle server logs nothing."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("l3worker.serving.stats")

_SAMPLES = {"l3worker:prompt_tokens_total": "prompt", "l3worker:generation_tokens_total": "generation",
            "l3worker:num_requests_running": "running", "l3worker:num_requests_waiting": "waiting",
            "l3worker:kv_cache_usage_perc": "kv", "l3worker:prefix_cache_queries_total": "queries",
            "l3worker:prefix_cache_hits_total": "hits"}


@dataclass
class Snapshot:
    """The sums over every engine of the series the line reads; kv is the mean over engines."""

    at: float
    prompt: float = 0.0
    generation: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv: float = 0.0
    queries: float = 0.0
    hits: float = 0.0

    @classmethod
    def parse(cls, text: str, at: float) -> "Snapshot":
        snap, engines = cls(at), 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = _SAMPLES.get(sample.name)
                if field is not None:
                    setattr(snap, field, getattr(snap, field) + sample.value)
                    engines += field == "kv"
        snap.kv /= max(engines, 1)
        return snap


def stats_line(before: Snapshot, now: Snapshot) -> str | None:
    """The line for the interval between two snapshots; None when nothing ran in it."""
    span = max(now.at - before.at, 1e-9)
    prompt, generation = now.prompt - before.prompt, now.generation - before.generation
    if not (prompt or generation or now.running or now.waiting):
        return None
    queries = now.queries - before.queries
    hit_rate = 100.0 * (now.hits - before.hits) / queries if queries else 0.0
    return (f"Avg prompt throughput: {prompt / span:.1f} tokens/s, Avg generation throughput: "
            f"{generation / span:.1f} tokens/s, Running: {now.running:.0f} reqs, Waiting: {now.waiting:.0f} reqs, "
            f"KV cache usage: {100.0 * now.kv:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")


class StatsLog:
    """Logs stats_line every `interval_s` from `engine.metrics_text()` while the server runs."""

    def __init__(self, engine, interval_s: float = 10.0):
        self.engine = engine
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._last: Snapshot | None = None

    async def tick(self) -> str | None:
        """Reads the metrics once; returns (and logs) the line for the time since the last read."""
        text = (await self.engine.metrics_text()).decode()
        now = Snapshot.parse(text, time.monotonic()) if text else None
        before, self._last = self._last, now or self._last
        line = stats_line(before, now) if before is not None and now is not None else None
        if line is not None:
            log.info("%s", line)
        return line

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a scrape that failed (an engine restarting) skips one line
                log.debug("stats scrape failed", exc_info=True)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
