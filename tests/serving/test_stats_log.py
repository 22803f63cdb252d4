"""The throughput line (vLLM's, unless --disable-log-stats), from two scrapes of the engine's
/metrics series: rates over the interval, every engine summed, nothing while idle."""
from __future__ import annotations

import asyncio

from l3worker.serving.stats_log import Snapshot, StatsLog, stats_line


def exposition(prompt: float, generation: float, running: float, kv: float, engines: int = 1) -> str:
    lines = []
    for e in range(engines):
        label = f'{{engine="{e}"}}'
        lines += [f"l3worker:prompt_tokens_total{label} {prompt}", f"l3worker:generation_tokens_total{label} {generation}",
                  f"l3worker:num_requests_running{label} {running}", f"l3worker:num_requests_waiting{label} 0.0",
                  f"l3worker:kv_cache_usage_perc{label} {kv}", f"l3worker:prefix_cache_queries_total{label} 100.0",
                  f"l3worker:prefix_cache_hits_total{label} 25.0"]
    return "\n".join(lines) + "\n"


def test_the_line_gives_rates_over_the_interval_summed_over_engines() -> None:
    before = Snapshot.parse(exposition(100, 50, 1, 0.25, engines=2), at=10.0)
    now = Snapshot.parse(exposition(200, 250, 2, 0.75, engines=2), at=12.0)
    assert stats_line(before, now) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 200.0 tokens/s, Running: 4 reqs, "
        "Waiting: 0 reqs, KV cache usage: 75.0%, Prefix cache hit rate: 0.0%")


def test_an_idle_interval_logs_nothing() -> None:
    idle = Snapshot.parse(exposition(100, 50, 0, 0.0), at=1.0)
    assert stats_line(idle, Snapshot.parse(exposition(100, 50, 0, 0.0), at=11.0)) is None


def test_stats_log_reads_the_engines_metrics_each_tick() -> None:
    class Engine:
        def __init__(self) -> None:
            self.texts = [exposition(0, 0, 0, 0.0), exposition(10, 20, 1, 0.5)]

        async def metrics_text(self) -> bytes:
            return self.texts.pop(0).encode()

    async def run() -> list[str | None]:
        log = StatsLog(Engine(), interval_s=10.0)
        return [await log.tick(), await log.tick()]

    first, second = asyncio.run(run())
    assert first is None  # nothing to compare with yet
    assert second.startswith("Avg prompt throughput: ") and "Running: 1 reqs" in second
