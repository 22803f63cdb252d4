"""Smoke test of scripts/bench_serve.py: the smallest --launch --offline run and its JSON's shape (the served
part in vLLM's field names, from l3worker/bench).
No timing is asserted: the figures are for people."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_serve.py"


def test_launch_offline_poisson_run(tmp_path) -> None:
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--launch", "--offline", "--num-prompts", "6", "--input-len", "16",
         "--output-len", "8", "--random-range-ratio", "0.5", "--request-rate", "200", "--max-concurrency", "3",
         "--max-num-seqs", "2", "--max-model-len", "64", "--block-size", "16", "--result-file", str(out),
         "--step-trace", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    served = result["served"]
    assert (served["completed"], served["failed"]) == (6, 0)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{key}_ms", f"median_{key}_ms", f"p99_{key}_ms"} <= set(served)
        # Chunks that reach the client together (a busy machine) are microseconds apart: an ITL
        # median may round to 0, the others cannot.
        assert served[f"median_{key}_ms"] >= 0 if key == "itl" else served[f"median_{key}_ms"] > 0
    assert served["output_throughput"] > 0 and served["request_throughput"] > 0
    assert all(4 <= r["output_tokens"] <= 12 and r["success"] for r in result["per_request"])
    assert result["offline"]["tpot_p50_ms"] > 0 and result["ratios"]["tpot_p50_over_offline_tpot_p50_median"] > 0
    assert result["server_after"]["l3worker:kv_cache_usage_perc"] == 0
    assert result["server_exit_code"] == 0
    assert "served TPOT p50 / offline TPOT p50" in proc.stdout
    # --step-trace: the served engine's step records, every sampled token in one, and their breakdown
    steps = json.loads((tmp_path / "served_steps.json").read_text())
    assert sum(s["rows"] for s in steps) >= sum(r["output_tokens"] for r in result["per_request"])
    assert sum(s["prefill_tokens"] for s in steps) >= sum(r["prompt_len"] for r in result["per_request"])
    assert result["offline"]["steps"] and "step breakdown" in proc.stdout and "slow_steps" in proc.stdout
