"""scripts/peer_run_medians.py: medians over repeated runs of scripts/bench_peers.sh, from the logs
the peers kit's driver leaves in each run directory (written here as the tools print them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peer_run_medians.py"
sys.path.insert(0, str(SCRIPT.parent))

from peer_run_medians import report, run_figures  # noqa: E402


def client_log(tok_s: float, ttft: float, tpot: float, itl: float, ok: int = 64, generated: int = 64 * 128) -> str:
    return (f"Successful requests:                     {ok}\nTotal generated tokens:                  {generated}\n"
            f"Output token throughput (tok/s):         {tok_s}\nMedian TTFT (ms):                        {ttft}\n"
            f"Median TPOT (ms):                        {tpot}\nP99 ITL (ms):                            {itl}\n")


def write_run(root: Path, name: str, l3: float, vllm: float, llama: float, llama_generated: int = 64 * 128) -> Path:
    """A run whose engines' figures scale with l3, vllm and llama (tok/s up, times down)."""
    run = root / name
    run.mkdir()
    (run / "compute_limit.log").write_text("a kernel line\nround 1: limit 800 output tok/s (decode pass 9 ms)\n")
    (run / "c_bench.log").write_text("| qwen3 | 1 | CPU | 2 | tg128 | 100.00 ± 0.80 |\n")
    for short, scale in (("l", l3), ("v", vllm), ("c", llama)):
        if short != "c":
            (run / f"{short}_tput.log").write_text(f"Throughput: 2 requests/s, 5 total tokens/s, {500 * scale} "
                                                   "output tokens/s\n")
        (run / f"{short}_startup_s").write_text(f"{10 / scale}\n")
        generated = llama_generated if short == "c" else 64 * 128
        for clients in (1, 16):
            (run / f"{short}_serve_c{clients}.log").write_text(
                client_log(clients * 50 * scale, 100 / scale, 10 / scale, 20 / scale, generated=generated))
    return run


def test_each_runs_figures_are_read_from_the_tools_output(tmp_path: Path) -> None:
    f = run_figures(write_run(tmp_path, "128m-1", l3=2.0, vllm=1.0, llama=1.6), output_len=128)
    assert f["offline tok/s", "l3worker"] == 1000 and f["offline tok/s", "vllm"] == 500
    assert f["c16 tok/s", "llama.cpp"] == 1280 and f["c1 TTFT p50", "l3worker"] == 50
    assert f["compute limit tok/s", "l3worker"] == 800 and f["launch s", "vllm"] == 10
    assert f["decode ms/token (llama-bench tg)", "llama.cpp"] == 10
    assert ("offline tok/s", "llama.cpp") not in f  # the driver runs no offline llama.cpp


def test_llama_cpp_figures_count_only_with_the_tokens_asked_for(tmp_path: Path) -> None:
    f = run_figures(write_run(tmp_path, "r", l3=2.0, vllm=1.0, llama=1.6, llama_generated=64 * 100), 128)
    assert not [key for key in f if key[1] == "llama.cpp" and key[0].startswith("c1")]
    assert ("c16 tok/s", "llama.cpp") not in f and ("c16 tok/s", "l3worker") in f


def test_ratios_are_the_median_of_each_runs_ratio_and_each_target_says_met_or_not(tmp_path: Path) -> None:
    runs = [write_run(tmp_path, "r1", 2.0, 1.0, 1.6), write_run(tmp_path, "r2", 3.0, 1.0, 3.0),
            write_run(tmp_path, "r3", 1.0, 1.0, 2.0)]
    lines = report(runs)
    assert "| 16 clients: tok/s vs vLLM | 2.00, 3.00, 1.00 | 2.00 | >= 1.3 | yes |" in lines
    assert "| 16 clients: tok/s vs llama.cpp | 1.25, 1.00, 0.50 | 1.00 | >= 1.1 | no |" in lines
    # l3worker's offline 1000, 1500, 500 tok/s against the limit of 800
    assert "| offline: share of the compute limit | 1.25, 1.88, 0.62 | 1.25 | >= 0.65 | yes |" in lines
    assert "| c16 tok/s | 800 | 1,600 | 1,600 |" in lines  # the engines' own medians, run by run
    assert "| launch vs vLLM | 0.50, 0.33, 1.00 | 0.50 | <= 0.25 | no |" in lines


def test_a_target_no_run_measured_says_so(tmp_path: Path) -> None:
    run = write_run(tmp_path, "r1", 2.0, 1.0, 1.6)
    (run / "compute_limit.log").unlink()
    assert "| offline: share of the compute limit | - | - | >= 0.65 | not measured |" in report([run])


def test_the_command_refuses_a_path_that_is_not_a_run(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "absent")], capture_output=True, text=True)
    assert done.returncode == 2 and "not a run directory" in done.stderr
