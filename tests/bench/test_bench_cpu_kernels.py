"""Smoke tests of scripts/bench_cpu_kernels.py and scripts/bench_cpu_gemm.py: the tiniest runs
print a figure for every variant asked for."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_kernels_prints_every_variant() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_kernels.py"), "--repeats", "1",
                          "--variants", "all_on,no_decode_attention,all_off", "--num-prompts", "2",
                          "--input-len", "8", "--output-len", "4", "--max-num-seqs", "2"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    table = out.split("variant")[-1].splitlines()[1:]
    assert [row.split()[0] for row in table] == ["all_on", "no_decode_attention", "all_off"]
    assert float(table[0].split()[2]) == 1.0  # the first variant is the base of the ratios
    assert all(float(row.split()[1]) > 0 for row in table)


def test_bench_cpu_kernels_refuses_an_unknown_variant() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_kernels.py"), "--variants", "all_on,fast"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--variants: unknown ['fast']" in done.stderr


def test_bench_cpu_gemm_prints_each_kernel() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_gemm.py"), "--layers", "1", "--rows", "1,5",
                          "--repeats", "1", "--hidden", "128", "--intermediate", "256", "--heads", "2",
                          "--kv-heads", "1"], capture_output=True, text=True, timeout=300, check=True).stdout
    names = {line.split()[2] for line in out.splitlines() if line.startswith("rows")}
    assert {"prepacked", "plain"} <= names
