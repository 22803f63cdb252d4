"""Smoke tests of scripts/bench_cpu_kernels.py, scripts/bench_cpu_gemm.py and scripts/bench_prefill.py:
the tiniest runs print a figure for every variant asked for."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chip_child.cpu_kernels import bf16_amx, bf16_linear, decode_attention, huge_pages
from chip_child.cpu_kernels.build import first_usable

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_kernels_prints_every_variant() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_kernels.py"), "--repeats", "1",
                          "--variants", "all_on,all_off", "--num-prompts", "2",
                          "--input-len", "8", "--output-len", "4", "--max-num-seqs", "2"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    table = out.split("variant")[-1].splitlines()[1:]
    assert [row.split()[0] for row in table] == ["all_on", "all_off"]
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
    ours = bf16_linear.best_kernel()
    amx = ours is not None and ours[0] == "avx512_bf16" and bf16_amx.KERNEL.usable()  # every k here fits AMX
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # AVX2 cpus: no bf16 in oneDNN
    want = {"plain", "f32-packed", *(["l3worker"] if ours else []), *(["amx"] if amx else []),
            *(["prepacked"] if onednn_bf16 else [])}
    assert names == want
    assert f"our kernel: {ours[0] if ours else 'none'}" in out


def test_bench_prefill_prints_the_step_and_each_projection_shape() -> None:
    """The built-in model's prompt of 24 tokens: one line per projection shape, each with all of
    the prompt's rows (no idle lane beside them) or, for the lm_head, the last token's."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_prefill.py"), "--input-len", "24", "--repeats", "2",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.startswith("prefill of 24 tokens, float32")
    shapes = [line.split(":")[0].split() for line in out.splitlines() if " x " in line.split(":")[0]]
    rows = {int(s[0]) for s in shapes}
    assert 24 in rows and rows <= {24, 1} and len(shapes) >= 2
    assert float(out.rsplit("projections:", 1)[1].split()[0]) > 0


def assert_times_both_against_head(script: str, args: list[str], rows: tuple[str, str]) -> None:
    """`script --against HEAD`: the working tree's kernel and HEAD's are timed at each row count,
    in that order, and give the same bits (the first is the base of the ratios)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args, "--against", "HEAD"],
                         capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    printed = [line.split() for line in out.splitlines() if line.startswith("rows")]
    assert [(r[1], r[2]) for r in printed] == [(m, name) for m in rows for name in ("l3worker", "@HEAD")]
    assert "differ" not in out and printed[0][-1] == "x1.000"


@pytest.mark.skipif(bf16_linear.best_kernel() is None, reason="neither bf16 projection kernel runs here")
def test_bench_cpu_gemm_times_our_kernel_against_a_past_revision() -> None:
    """--against builds the kernel in use (the AVX-512 one, or the AVX2 one on a cpu without
    AVX-512: built with the other's flags it would die of an illegal instruction) from git and
    alternates it with the working tree's: against HEAD both are timed and give the same bits."""
    assert_times_both_against_head("bench_cpu_gemm.py", ["--layers", "1", "--rows", "1,8", "--repeats", "1", "--hidden",
                                                         "128", "--intermediate", "256", "--heads", "2", "--kv-heads",
                                                         "1"], ("1", "8"))


@pytest.mark.skipif(bf16_linear.best_kernel() is None, reason="neither bf16 projection kernel runs here")
def test_a_past_kernel_builds_with_its_own_revisions_headers(tmp_path: Path) -> None:
    """The past source meets the headers it was written against (a header's functions can change
    between revisions), written beside it, where its quoted includes look first."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench_common import past_cpu_kernel
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert past_cpu_kernel(first_usable(bf16_linear.KERNEL, bf16_linear.AVX2_KERNEL), "HEAD",
                           str(tmp_path)) is not None
    for name in ("bf16_packing.h", "block_shares.h"):
        head = subprocess.run(["git", "show", f"HEAD:chip_child/cpu_kernels/{name}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
        assert (tmp_path / name).read_text() == head


@pytest.mark.skipif(decode_attention.library() is None, reason="neither decode attention kernel runs here")
def test_bench_cpu_attention_times_the_kernel_against_a_past_revision() -> None:
    """--against builds the kernel in use (decode_attention.cpp or its AVX2 version) from git and
    alternates it with the working tree's on the same caches: against HEAD both are timed, at each
    row count, and give the same bits."""
    assert_times_both_against_head("bench_cpu_attention.py", ["--layers", "1", "--rows", "1,3", "--repeats", "1",
                                                              "--kv-heads", "2", "--group", "3", "--page-size", "16",
                                                              "--max-context", "40", "--shuffle"], ("1", "3"))


@pytest.mark.skipif(bf16_linear.best_kernel() is None, reason="neither bf16 projection kernel runs here")
@pytest.mark.skipif(not huge_pages.STATS.system_allows, reason="no transparent huge pages here")
def test_bench_cpu_huge_pages_times_both_copies(make_checkpoint) -> None:
    ck = make_checkpoint("bench_huge_pages", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_huge_pages.py"), "--model", str(ck), "--rows",
                          "1,2", "--repeats", "2", "--steps", "2", "--prompt-len", "4"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("rows") and "huge / small" in line]
    assert [line.split()[1] for line in lines] == ["1:", "2:"]
    assert all(len(line.split("per repeat")[1].split(",")) == 2 for line in lines)


def _compute_limit_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compute_limit", ROOT / "scripts/bench_compute_limit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compute_limit_counts_decode_passes_prompt_chunks_and_lm_head_rows() -> None:
    """With pass times fixed: 5 prompts, 2 at a time, are 3 waves of (output-len - 1) decode
    passes; 5 x 12 prompt tokens are 60 / 4 chunk passes; each prompt adds one lm_head row."""
    bench = _compute_limit_module()

    class Fixed:
        name, bytes, layer_flops = "fixed", 1e6, 1e6

        def time_pass(self, rows: int, layers: bool, lm_head: bool, repeats: int) -> float:
            return {(2, True, True): 0.010, (4, True, False): 0.020, (1, False, True): 0.0005}[(rows, layers, lm_head)]

    args = bench.argparse.Namespace(num_prompts=5, input_len=12, output_len=7, max_num_seqs=2, chunk=4, repeats=3)
    got = bench.limit(Fixed(), args)
    seconds = 3 * 6 * 0.010 + 60 / 4 * 0.020 + 5 * 0.0005
    assert got["seconds"] == pytest.approx(seconds)
    assert got["tok_s"] == pytest.approx(5 * 7 / seconds)


@pytest.mark.skipif(bf16_linear.best_kernel() is None, reason="neither bf16 projection kernel runs here")
def test_bench_compute_limit_prints_the_limit_and_offline_against_it(make_checkpoint) -> None:
    ck = make_checkpoint("bench_limit", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_compute_limit.py"), str(ck), "--offline", "1",
                          "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--max-num-seqs", "2",
                          "--chunk", "8", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("round 1:"))
    limit = float(line.split("limit ")[1].split()[0])
    offline = float(line.split("offline ")[1].split()[0])
    assert limit > 0 and offline > 0
    share = float(line.split(", ")[-1].split()[0])  # the figures are printed rounded to whole tok/s
    assert (offline - 0.5) / (limit + 0.5) - 0.005 <= share <= (offline + 0.5) / max(limit - 0.5, 0.5) + 0.005


def test_bench_compute_limit_refuses_a_zero_batch(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_compute_limit.py"), str(tmp_path),
                           "--max-num-seqs", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--max-num-seqs must be at least 1, got 0" in done.stderr
