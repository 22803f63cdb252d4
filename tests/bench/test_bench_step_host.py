"""Smoke test of scripts/bench_step_host.py: the tiniest run splits each decode step into the
layers' call, the lm_head and the host's rest, and gives one token digest over its repeats."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from chip_child.cpu_kernels import decode_layers

from checkpoints import write_hf_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not decode_layers.KERNEL.usable(), reason=f"unusable here: {decode_layers.KERNEL.why_not()}")
def test_bench_step_host_splits_each_step(tmp_path) -> None:
    ck = write_hf_checkpoint(tmp_path / "ck", head_dim=32)  # a shape the one-call layers take
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_step_host.py"), "--model", str(ck),
                          "--repeats", "2", "--prompt-len", "6", "--new-tokens", "5"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    repeats = re.findall(r"^repeat \d: step p50 ([\d.]+) ms, per step: layers ([\d.]+), lm_head ([\d.]+), "
                         r"the rest (-?[\d.]+)$", out, re.M)
    assert len(repeats) == 2
    assert all(float(step) > 0 and float(layers) > 0 for step, layers, _, _ in repeats)
    assert re.search(r"^median of 2: .*; tokens [0-9a-f]{16}$", out, re.M)  # one digest: the same tokens


def test_bench_step_host_says_where_the_layers_do_not_run(tmp_path) -> None:
    ck = write_hf_checkpoint(tmp_path / "ck")  # head size 24: the one-call layers refuse it
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_step_host.py"), "--model", str(ck),
                           "--repeats", "1", "--prompt-len", "4", "--new-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "the one-call decode layers do not run here" in done.stderr
