"""scripts/bench_gpu.py end to end on the cpu with a tiny shape: every variant that runs there
reports its figures and the l3 variants give the floor's tokens. The figures themselves come from
a GPU (README, "Measuring")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf_static variant
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"


def test_bench_gpu_smoke_run_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny", "--batches", "1,2",
                           "--prompt-len", "9", "--new-tokens", "5", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["info"]["bandwidth_bytes_per_s"] > 0
    rows = result["models"]["tiny"]["batches"]
    assert sorted(rows) == ["1", "2"]
    for row in rows.values():
        assert row["step_bytes"] > 0 and row["roofline_s"] > 0
        # floor_unfused runs on cuda only: on the cpu the fused kernels are off anyway.
        assert set(row["variants"]) == {"floor", "floor_eager", "l3", "l3_in_order", "l3_eager", "hf_static"}
        for v in row["variants"].values():
            assert v["step_s"] > 0 and v["x_roofline"] > 0
        assert row["variants"]["l3"]["tokens_equal_reference"] and row["variants"]["l3_eager"]["tokens_equal_reference"]
    assert "| tiny | 2 |" in proc.stdout


def test_step_bytes_count_each_weight_once_and_the_kv_read() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_gpu import SHAPES
    finally:
        sys.path.remove(str(SCRIPT.parent))
    s = SHAPES["0.6b"]
    # Qwen3-0.6B: about 0.6e9 parameters with the tied embedding counted once as the lm_head.
    weights = s.step_bytes(1, 0, 2) - s.kv_bytes_per_token(2)
    assert 1.1e9 < weights < 1.25e9
    # One more row at the same context adds its K/V read and write only (the table is tied).
    assert s.step_bytes(2, 100, 2) - s.step_bytes(1, 100, 2) == 101 * s.kv_bytes_per_token(2)
    # Untied: one more row also reads one more embedding row.
    e = SHAPES["8b"]
    assert e.step_bytes(2, 100, 2) - e.step_bytes(1, 100, 2) == 101 * e.kv_bytes_per_token(2) + e.hidden_size * 2


def test_bench_fp8_smoke_run_on_the_cpu() -> None:
    """scripts/bench_fp8.py on the cpu: every variant runs; there fp8 is dequantized at load, so its
    tokens are the dequantized reference's exactly."""
    script = SCRIPT.parent / "bench_fp8.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--models", "tiny", "--batches", "2",
                           "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[tiny] fp8: projections plain" in proc.stdout
    row = proc.stdout.strip().splitlines()[-1].split()
    assert row[0] == "2" and row[-1] == "100.0%", proc.stdout
