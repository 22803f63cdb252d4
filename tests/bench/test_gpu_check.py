"""scripts/gpu_check.sh outside a GPU machine, and its summary of what each step left: the whole
pipeline runs on a GPU (or with --cpu-smoke by hand, about a minute here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_and_runs_nothing(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "OUT": str(tmp_path)},
                          timeout=120)
    assert done.returncode == 2 and "torch sees no CUDA device" in done.stderr
    assert not any((tmp_path / "gpu_check").iterdir())


def test_the_summary_names_each_steps_status_and_fails_when_one_did(tmp_path: Path) -> None:
    (tmp_path / "tests.rc").write_text("0\n")
    (tmp_path / "tests.xml").write_text('<testsuites><testsuite tests="10" failures="1" errors="0" skipped="2">'
                                        "</testsuite></testsuites>")
    (tmp_path / "decode.rc").write_text("124\n")  # killed by its time limit
    (tmp_path / "fp8.rc").write_text("0\n")
    (tmp_path / "fp8.log").write_text("batch bf16 fp8\n    1     2.50     1.40    1.90   0.56   100.0%\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # a step timed out, others never ran
    rows = [line.split(" | ") for line in done.stdout.splitlines()[2:]]
    by_step = {r[0].strip("| "): r for r in rows}
    assert by_step["tests"][1:] == ["ok", "tests passed / failed / skipped", "7 / 1 / 2 |"]
    assert by_step["decode"][1] == "timed out" and by_step["decode"][3] == "no result |"
    assert by_step["fp8"][3] == "1 2.50 1.40 1.90 0.56 100.0% |"
    assert by_step["spec"][1] == "not run" and by_step["serve"][1] == "not run"
