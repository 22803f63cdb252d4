"""examples/monitoring: every series the Grafana dashboard queries exists on a live server's /metrics,
and the Prometheus config scrapes that path."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from l3worker import DistributedWorker
from l3worker.serving.runner import ServeOptions, ServerThread

MONITORING = Path(__file__).resolve().parents[2] / "examples" / "monitoring"
METRIC_NAME = re.compile(r"\bl3worker:[A-Za-z0-9_:]+")


def dashboard_exprs() -> list[str]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def exposed_series(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_the_dashboard_queries_exists_on_a_live_server() -> None:
    exprs = dashboard_exprs()
    wanted = {name for e in exprs for name in METRIC_NAME.findall(e)}
    # The panels the dashboard promises: latency, queue, load, cache and preemption figures.
    for needed in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "prefix_cache_queries_total", "num_preemptions_total", "engine_restarts_total",
                   "lora_requests_info"):
        assert "l3worker:" + needed in wanted, needed
    worker = DistributedWorker(None, max_batch_size=2, max_seq_len=256, page_size=16, enable_lora=True)
    with ServerThread(worker, options=ServeOptions(port=0)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}).status_code == 200
            exposed = exposed_series(client.get("/metrics").text)
    missing = sorted(wanted - exposed)
    assert not missing, f"the dashboard queries series /metrics does not export: {missing}"


def test_prometheus_config_scrapes_the_metrics_path() -> None:
    text = (MONITORING / "prometheus.yml").read_text()
    assert re.search(r"^\s+metrics_path: /metrics$", text, re.M)
    assert re.search(r"^\s+- targets: \[\"127\.0\.0\.1:\d+\"\]$", text, re.M)
