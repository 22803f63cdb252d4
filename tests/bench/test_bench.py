"""Smoke test of scripts/bench_decode.py: the tiniest run, its JSON's shape and token agreement.

No timing is asserted: the benchmark's figures are for people, the test checks that it runs, reports
every field it promises, and that every L3 variant made the floor's tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the benchmark writes its checkpoints with it

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"
PER_VARIANT = ("tpot_p50_s", "tpot_p99_s", "ratio_to_floor", "command_bytes_per_step", "h2d_copies_per_step",
               "pool_allocs_per_step")
SIZES = (128, 1024)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "2", "--steps", "8", "--json", str(out),
         "--submission-sizes", ",".join(map(str, SIZES))],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_every_variant_reports_every_figure(bench) -> None:
    _, result = bench
    assert set(result["workloads"]) == {"overhead"}
    wl = result["workloads"]["overhead"]
    assert wl["workload"]["new_tokens"] == 8 and wl["workload"]["batch"] == 16
    variants = wl["variants"]
    assert set(variants) == {"floor", "l3", "l3_depth1", "l3_always", "hf"}
    for name, v in variants.items():
        for key in PER_VARIANT:
            assert key in v, (name, key)
        assert v["tpot_p50_s"] > 0 and v["tpot_p99_s"] >= v["tpot_p50_s"], name
        assert len(v["tpot_p50_per_repeat_s"]) == 2, name
        assert v["decode_steps_per_repeat"] == 7, name  # the prefill makes the first of the 8 tokens
    assert variants["floor"]["ratio_to_floor"] == pytest.approx(1.0)
    for name in ("l3", "l3_depth1", "l3_always"):
        assert isinstance(variants[name]["command_bytes_per_step"], (int, float)), name
    assert variants["hf"]["cache"] in ("static", "dynamic")
    assert variants["hf"]["command_bytes_per_step"] is None  # nothing crosses a wire in-process


def test_variants_made_identical_tokens(bench) -> None:
    proc, result = bench
    wl = result["workloads"]["overhead"]
    assert wl["tokens_match"] is True and wl["mismatches"] == []
    digests = {wl["variants"][n]["tokens_sha256"] for n in ("floor", "l3", "l3_depth1", "l3_always")}
    assert len(digests) == 1
    assert "produced identical token ids" in proc.stdout


def test_diff_only_commands_are_smaller_than_full_state(bench) -> None:
    _, result = bench
    v = result["workloads"]["overhead"]["variants"]
    assert v["l3"]["command_bytes_per_step"] < v["l3_always"]["command_bytes_per_step"]


def test_submission_setup_and_machine_sections(bench) -> None:
    proc, result = bench
    sizes = result["prompt_submission"]["sizes"]
    assert [r["tokens"] for r in sizes] == list(SIZES)
    for r in sizes:
        assert r["list_s"] > 0 and r["array_s"] > 0 and r["ratio"] == pytest.approx(r["list_s"] / r["array_s"])
    setup = result["setup"]["overhead"]
    assert setup["first_setup_s"] >= setup["prepare_s"] > 0  # the first generate includes prepare()
    assert setup["later_setup_s_p50"] is not None
    assert {"cpu", "cores", "torch", "threads"} <= set(result["machine"])
    assert result["machine"]["threads"] == 1
    assert "| variant |" in proc.stdout and "| prompt tokens |" in proc.stdout
    assert all({"target", "value", "met"} == set(t) for t in result["targets"])


def test_op_count_reports_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.with_name("count_ops.py")), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(out.read_text())["ops_per_decode_step"]
    assert set(counts) == {"runtime", "transformers"}
    assert all(isinstance(n, int) and n > 0 for n in counts.values())
    assert f"runtime {counts['runtime']}, transformers generate {counts['transformers']}" in proc.stdout
