"""Smoke test of scripts/bench_cpu.py: the tiniest run, its JSON's shape and token agreement.

No timing is asserted: the figures are for people; the test checks that every variant runs and
reports its figures, and that the l3 variants made the same tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chip_child.device import available_cores

pytest.importorskip("transformers")  # the benchmark writes its checkpoints with it and runs it

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_cpu.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-cpu") / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workload", "tiny", "--repeats", "1", "--batch", "3", "--prompt-len", "20",
         "--new-tokens", "4", "--quiet-wait", "0", "--max-other", "99", "--floor", "--l3", "depth1:pipeline_depth=1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_variant_reports_its_figures(result: dict) -> None:
    wl = result["workloads"]["tiny"]
    assert wl["workload"]["output_tokens"] == 3 * 4 and len(wl["workload"]["prompt_lens"]) == 3
    variants = wl["variants"]
    assert {"l3", "l3_prefill", "l3_depth1", "floor", "hf_static", "hf_dynamic", "hf_batch"} <= set(variants)
    assert not wl["errors"]
    for name, v in variants.items():
        assert v["ms_per_token"] > 0 and len(v["ms_per_token_per_repeat"]) == 1, name
        assert v["vs_l3"] is not None and v["vs_hf_best_generate"] is not None and v["vs_hf_batch"] is not None
    assert variants["l3"]["vs_l3"] == pytest.approx(1.0)
    assert all(v["process_cpu_us_per_token"] >= 0 and v["children_cpu_us_per_token"] >= 0 for v in variants.values())
    assert variants["hf_static"]["children_cpu_us_per_token"] == 0  # transformers starts no chip-child
    assert wl["hf_best_generate"] in ("hf_static", "hf_dynamic")
    if available_cores() > 1:  # the default's start-up choice between the two layouts, and each alone
        assert {"l3_every", "l3_spare"} <= set(variants)
        assert variants["l3"]["info"]["cpu_layout"] in ("every_core", "spare_core")
        assert set(variants["l3"]["info"]["cpu_layout_step_ms"]) == {"every_core", "spare_core"}
        assert variants["l3"]["info"]["cpu_layout_preferred"] == "spare_core"  # the tiny model
        assert variants["l3_every"]["info"]["cpu_layout"] == "every_core"
        assert variants["l3_every"]["info"]["cpu_layout_step_ms"] == {}  # not timed
    assert result["l3_variants"]["l3_depth1"] == {"options": {"pipeline_depth": 1}, "env": {}}


def test_l3_variants_made_identical_tokens(result: dict) -> None:
    wl = result["workloads"]["tiny"]
    assert wl["l3_tokens_identical"] is True
    assert wl["token_agreement_with_l3"]["floor"] == 1.0  # the same runtime in one process


def test_bench_top_k_top_p_times_every_variant_against_a_revision() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT.with_name("bench_top_k_top_p.py")), "--vocab", "4096", "--batch", "2",
                          "--rounds", "1", "--calls", "2", "--against", "HEAD"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [r[0].strip() for r in rows] == ["greedy", "temperature", "qwen3", "top_k", "top_p", "top_p_wide"]
    assert all(float(cell) > 0 for r in rows for cell in r[1:])
    assert "tokens differing from HEAD's: greedy 0 of 4, temperature " in out
