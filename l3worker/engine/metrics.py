"""The engine's serving figures, kept in a prometheus_client registry of its own.

Each engine has its own registry, so several engines in one process (tests, a benchmark) never
share a series; the server exports it as is. Gauges are read from the scheduler when scraped, so
the step loop pays nothing for them.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

# Bucket edges in seconds, from sub-millisecond steps of a tiny model to minutes-long requests.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
        0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort")


class EngineMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int], kv_usage: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("l3worker:num_requests_running", "Requests with a sample in a batch row", registry=r).set_function(running)
        Gauge("l3worker:num_requests_waiting", "Requests waiting for a row or KV pages",
              registry=r).set_function(waiting)
        Gauge("l3worker:kv_cache_usage_perc", "Fraction of KV pages in use (0 to 1)", registry=r).set_function(kv_usage)
        self.prompt_tokens = Counter("l3worker:prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("l3worker:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("l3worker:request_success", "Finished requests by reason",
                                       ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)  # every series exists from the start, at 0
        self.prefix_cache_queries = Counter("l3worker:prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache", registry=r)
        self.prefix_cache_hits = Counter("l3worker:prefix_cache_hits", "Prompt tokens the prefix cache supplied",
                                         registry=r)
        self.preemptions = Counter("l3worker:num_preemptions", "Sequences preempted when KV pages ran out",
                                   registry=r)
        self.engine_restarts = Counter("l3worker:engine_restarts", "Restarts of the chip-children after one died, "
                                       "raised or hung", registry=r)
        self.grammar_failures = Counter("l3worker:structured_output_failures", "Requests failed because a token "
                                        "their grammar refused got through (the child's matcher broke)", registry=r)
        # Speculative decoding, vLLM's meanings (l3worker.engine.speculation): zero without it.
        self.spec_drafts = Counter("l3worker:spec_decode_num_drafts", "Draft proposals verified (one per row "
                                   "and step)", registry=r)
        self.spec_draft_tokens = Counter("l3worker:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("l3worker:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_undrafted_tokens = Counter("l3worker:spec_decode_num_undrafted_tokens", "Tokens decoded without "
                                             "a draft while speculating (prompt-chunk steps, penalized or "
                                             "constrained rows, nothing proposed)", registry=r)
        self.spec_accepted_per_position = Counter("l3worker:spec_decode_num_accepted_tokens_per_pos",
                                                  "Draft tokens accepted, by position in the draft", ["position"],
                                                  registry=r)
        self._cpu_layout = Gauge("l3worker:cpu_layout_info", "The cpu layout the chip-children run with "
                                 "(every_core or spare_core), as a label of a series set to 1; none off the cpu",
                                 ["layout"], registry=r)
        self.ttft = Histogram("l3worker:time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("l3worker:inter_token_latency_seconds", "Between two tokens of a sample",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("l3worker:e2e_request_latency_seconds", "Arrival to the request's end",
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("l3worker:request_queue_time_seconds", "Arrival to admission into a row",
                                    buckets=_LATENCY, registry=r)

    def observe_itl(self, gaps: dict[float, int]) -> None:
        """A step's inter-token gaps, each with how many samples had it (rows decoded in
        consecutive steps all share one)."""
        for gap, count in gaps.items():
            observe_repeated(self.itl, gap, count)

    def set_cpu_layout(self, layout: str | None) -> None:
        """The layout the children (re)started with: the one series of the info metric."""
        self._cpu_layout.clear()
        if layout is not None:
            self._cpu_layout.labels(layout).set(1)

    def track_lora(self, info: Callable[[], tuple[int, list[str], list[str]]]) -> None:
        """vLLM's lora_requests_info: `info()` gives max_loras and the running and waiting adapters' names."""
        self.registry.register(_LoraInfo(info))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value, e.g. value("l3worker:generation_tokens_total")."""
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got


class _LoraInfo:
    """One series whose labels name the adapters in use (comma-separated), set to the scrape's time.
    Described with a metric's attributes, so the docs' metrics reference lists it as one."""

    _name, _type = "l3worker:lora_requests_info", "gauge"
    _documentation = "LoRA adapters of running and waiting requests (labels), set to the time of the scrape"
    _labelnames = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

    def __init__(self, info: Callable[[], tuple[int, list[str], list[str]]]):
        self.info = info

    def collect(self):
        max_lora, running, waiting = self.info()
        family = GaugeMetricFamily(self._name, self._documentation, labels=list(self._labelnames))
        family.add_metric([str(max_lora), ",".join(running), ",".join(waiting)], time.time())
        yield family


def observe_repeated(histogram: Histogram, value: float, count: int) -> None:
    """Records `value` `count` times, exactly as `count` calls of observe() would, for the cost of
    one: prometheus_client has no weighted observe, so this adds to the bucket and sum counters
    its observe() adds to (tests/engine/test_outputs.py checks the two agree)."""
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets):
        if value <= bound:
            bucket.inc(count)
            break


def families_to_wire(registry: CollectorRegistry, engine: int) -> list:
    """The registry's samples as plain lists, each labelled with `engine` (vLLM's convention), for
    an engine-core process to send to an API server, which merges every engine's (`exposition`)."""
    return [[f.name, f.documentation, f.type, f.unit,
             [[s.name, {**s.labels, "engine": str(engine)}, s.value] for s in f.samples]]
            for f in registry.collect()]


def exposition(engines: list[list]) -> bytes:
    """One Prometheus exposition of several engines' families_to_wire lists: a family appears
    once, with the samples of every engine."""
    merged: dict[str, Metric] = {}
    for families in engines:
        for name, doc, kind, unit, samples in families:
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, doc, kind, unit)
            for sample_name, labels, value in samples:
                metric.add_sample(sample_name, labels, value)

    class _Merged:
        def collect(self):
            return merged.values()

    return generate_latest(_Merged())
