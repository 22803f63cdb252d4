"""Smoke test of scripts/bench_launch.py: one round on the built-in model, this checkout against
itself as the baseline, prints each launch, both medians and their ratio; nothing is left running."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from chip_child.models.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_one_round_against_a_baseline_prints_every_launch_and_the_medians() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_launch.py"), str(ensure_tiny_model()),
                          "--rounds", "1", "--baseline", str(ROOT),
                          "--flags", "--max-num-seqs 1 --max-model-len 64 --block-size 16"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    launches = re.findall(r"^round 1: (\S+): ([0-9.]+) s$", out, re.M)
    assert [Path(p) for p, _ in launches] == [ROOT, ROOT] and all(float(s) > 0 for _, s in launches)
    medians = re.findall(r"^median ([0-9.]+) s \(([0-9.]+)x this checkout's\)", out, re.M)
    assert len(medians) == 2 and medians[0][1] == "1.00"


def test_a_server_that_cannot_start_is_reported_by_name(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_launch.py"), str(tmp_path / "no-model"),
                           "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "exited with 2 before /health said 200" in done.stderr
