"""Smoke test of scripts/serve_cpu_profile.py: a server with its counters, one streamed request
between SIGUSR1 and SIGUSR2, and the table it writes. No timing is asserted: the figures are for people."""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import Served, sse_events, stream_raw, wait_until
from l3worker.serving.inline_engine import inline_refusal

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "serve_cpu_profile.py"
TOKENS = 8


def _calls(table: str, name: str) -> int:
    m = re.search(rf"^\s+{re.escape(name)}\s+\S+ s\s+(\d+) calls", table, re.M)
    assert m, f"no {name} line in\n{table}"
    return int(m.group(1))


@pytest.mark.skipif(inline_refusal(1, 1, False) is not None, reason="the engine inline needs eventfd and x86")
def test_counts_the_step_loop_and_the_http_path_per_streamed_token() -> None:
    served = Served("--inline-engine", "--max-num-seqs", "2", "--max-model-len", "64",
                    command=[sys.executable, str(SCRIPT)])
    try:
        url = served.ready().group(1)
        with httpx.Client(base_url=url, timeout=60) as client:
            stream_raw(client, "/v1/completions", {"prompt": "warm", "max_tokens": 2, "stream": True})
            os.kill(served.proc.pid, signal.SIGUSR1)  # zero the counters: the warm-up is not counted
            wait_until(lambda: "serve_cpu_profile: counters zeroed" in served.stderr, what="the counters zeroed")
            _, raw = stream_raw(client, "/v1/completions", {"prompt": "Hello", "max_tokens": TOKENS, "stream": True,
                                                            "temperature": 0, "ignore_eos": True})
        assert sum(1 for e in sse_events(raw) if isinstance(e, dict) and e["choices"]) == TOKENS
        os.kill(served.proc.pid, signal.SIGUSR2)
        wait_until(lambda: any(line.startswith("process CPU") for line in served.stderr), what="the table")
        table = "\n".join(served.stderr[next(i for i, line in enumerate(served.stderr)
                                             if line.startswith("process CPU")):])
        assert f"({TOKENS} chunks;" in table.splitlines()[0]
        assert _calls(table, "Generation.events") == TOKENS
        assert _calls(table, "Engine._complete") >= TOKENS  # the engine runs in this process inline
        assert _calls(table, "Scheduler.next_command") >= TOKENS
        assert _calls(table, "RequestResponseCycle.send") >= TOKENS
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
    finally:
        served.stop()
