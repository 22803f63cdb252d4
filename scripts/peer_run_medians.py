"""Medians over repeated runs of scripts/bench_peers.sh: every engine's figure, l3worker's ratio to
each peer run by run (the median of the ratios, not the ratio of the medians: each run's engines
shared that run's machine state), and each target of the side-by-side, met or not.

    REPEATS=3 scripts/bench_peers.sh 128m
    python scripts/peer_run_medians.py ../peers-build/runs/128m-*

Reads the logs the peers kit's driver leaves in each run directory (vLLM's and l3worker's
`bench throughput | latency` and `bench serve` output, llama-bench's table, the launch times) and
compute_limit.log. A llama.cpp served figure counts only where its client saw the output tokens it
asked for (within 10%), as the driver's own table does; a figure a run lacks is left out of the median.
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

ENGINES = {"v": "vllm", "l": "l3worker", "c": "llama.cpp"}
SERVED = {"tok/s": "Output token throughput", "TTFT p50": "Median TTFT", "TPOT p50": "Median TPOT",
          "P99 ITL": "P99 ITL"}


def _number(path: Path, pattern: str) -> float | None:
    try:
        match = re.search(pattern, path.read_text(errors="replace"), re.M)
    except OSError:
        return None
    return float(match.group(1)) if match else None


def served(run: Path, engine: str, clients: int, output_len: int) -> dict[str, float]:
    """The client's figures for one engine and load; {} where the run has none it can trust."""
    log = run / f"{engine}_serve_c{clients}.log"
    figures = {name: _number(log, rf"^{re.escape(label)}[^:]*:\s*([0-9.]+)") for name, label in SERVED.items()}
    ok = _number(log, r"^Successful requests:\s*([0-9]+)")
    generated = _number(log, r"^Total generated tokens:\s*([0-9]+)")
    if engine == "c" and not (ok and generated and 0.9 <= generated / (ok * output_len) <= 1.1):
        return {}
    return {name: value for name, value in figures.items() if value is not None}


def run_figures(run: Path, output_len: int) -> dict[tuple[str, str], float]:
    """(figure, engine) -> value for one run directory."""
    out: dict[tuple[str, str], float] = {}
    for short, engine in ENGINES.items():
        tput = _number(run / f"{short}_tput.log", r"^Throughput: .*, ([0-9.]+) output tokens/s")
        launch = _number(run / f"{short}_startup_s", r"^([0-9.]+)")
        for name, value in (("offline tok/s", tput), ("launch s", launch)):
            if value is not None:
                out[name, engine] = value
        for clients in (1, 16):
            for name, value in served(run, short, clients, output_len).items():
                out[f"c{clients} {name}", engine] = value
    tg = _number(run / "c_bench.log", rf"\|\s*tg{output_len}\s*\|\s*([0-9.]+)")
    if tg:
        out["decode ms/token (llama-bench tg)", "llama.cpp"] = 1000 / tg
    limit = _number(run / "compute_limit.log", r"^round 1: limit ([0-9]+) output tok/s")
    if limit:
        out["compute limit tok/s", "l3worker"] = limit
    return out


# (label, numerator, denominator, at most / at least, bound): l3worker against a peer or itself
TARGETS = [
    ("16 clients: tok/s vs vLLM", ("c16 tok/s", "l3worker"), ("c16 tok/s", "vllm"), ">=", 1.3),
    ("16 clients: tok/s vs llama.cpp", ("c16 tok/s", "l3worker"), ("c16 tok/s", "llama.cpp"), ">=", 1.1),
    ("16 clients: P99 ITL vs vLLM", ("c16 P99 ITL", "l3worker"), ("c16 P99 ITL", "vllm"), "<=", 1.0),
    ("16 clients: P99 ITL vs llama.cpp", ("c16 P99 ITL", "l3worker"), ("c16 P99 ITL", "llama.cpp"), "<=", 1.0),
    ("16 clients: TPOT p50 vs vLLM", ("c16 TPOT p50", "l3worker"), ("c16 TPOT p50", "vllm"), "<=", 0.9),
    ("1 client: TTFT p50 vs vLLM", ("c1 TTFT p50", "l3worker"), ("c1 TTFT p50", "vllm"), "<=", 0.8),
    ("1 client: TPOT p50 vs llama.cpp", ("c1 TPOT p50", "l3worker"), ("c1 TPOT p50", "llama.cpp"), "<=", 1.0),
    ("offline: tok/s vs vLLM", ("offline tok/s", "l3worker"), ("offline tok/s", "vllm"), ">=", 1.3),
    ("offline: share of the compute limit", ("offline tok/s", "l3worker"), ("compute limit tok/s", "l3worker"),
     ">=", 0.65),
    ("served 16 clients / offline", ("c16 tok/s", "l3worker"), ("offline tok/s", "l3worker"), ">=", 0.9),
    ("launch vs vLLM", ("launch s", "l3worker"), ("launch s", "vllm"), "<=", 0.25),
]


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{median:,.0f}" if median >= 100 else f"{median:.3g}"


def report(runs: list[Path], output_len: int = 128) -> list[str]:
    per_run = [run_figures(run, output_len) for run in runs]
    names = sorted({key[0] for figures in per_run for key in figures})
    lines = [f"{len(runs)} runs: {', '.join(run.name for run in runs)}", "",
             f"| median | {' | '.join(ENGINES.values())} |", "| --- |" + " ---: |" * len(ENGINES)]
    for name in names:
        cells = [_fmt([f[name, engine] for f in per_run if (name, engine) in f]) for engine in ENGINES.values()]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += ["", "| target | run by run | median | asked | met |", "| --- | --- | ---: | --- | --- |"]
    for label, num, den, sense, bound in TARGETS:
        ratios = [f[num] / f[den] for f in per_run if num in f and den in f and f[den]]
        if not ratios:
            lines.append(f"| {label} | - | - | {sense} {bound} | not measured |")
            continue
        median = statistics.median(ratios)
        met = median >= bound if sense == ">=" else median <= bound
        lines.append(f"| {label} | {', '.join(f'{r:.2f}' for r in ratios)} | {median:.2f} | {sense} {bound} | "
                     f"{'yes' if met else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (PEERS_BUILD/runs/<size>-<n>)")
    parser.add_argument("--output-len", type=int, default=128, help="the runs' OUTPUT_LEN")
    args = parser.parse_args()
    missing = [str(run) for run in args.runs if not run.is_dir()]
    if missing:
        parser.error(f"not a run directory: {', '.join(missing)}")
    print("\n".join(report(args.runs, args.output_len)))


if __name__ == "__main__":
    main()
