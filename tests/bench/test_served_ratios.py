"""scripts/served_ratios.py: l3worker's served figures over each peer's, per round, from the
figures that scripts/bench_served_peers.sh writes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "served_ratios.py"
sys.path.insert(0, str(SCRIPT.parent))

from served_ratios import ratio_table, read_figures, variants  # noqa: E402


def write(tmp_path: Path, rows: list[tuple]) -> Path:
    path = tmp_path / "figures.tsv"
    path.write_text("".join("\t".join(str(v) for v in row) + "\n" for row in rows))
    return path


ROWS = [  # engine, round, load, tok/s, TTFT, TPOT, P99 ITL, failed, launch
    ("l3worker", 1, "c1", 100, 80, 9.0, 15, 0, 10.0),
    ("l3worker", 1, "c16rep", 800, 140, 18, 26, 0, 10.0),
    ("vllm", 1, "c1", 50, 160, 20.0, 30, 0, 50.0),
    ("vllm", 1, "c16rep", 400, 1000, 40, 52, 0, 50.0),
    ("llama", 1, "c1", 100, 100, 10.0, 15, 2, 0.5),
    ("llama", 1, "c16rep", "", 300, 36, 45, 0, 0.5),  # a figure the client did not print
    ("l3worker", 2, "c1", 90, 84, 9.9, 15, 0, 10.0),
    ("vllm", 2, "c1", 45, 150, 22.0, 27, 0, 50.0),
    ("llama", 2, "c1", 95, 106, 9.0, 14, 0, 0.5),
]


def cells(table: str, label: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")[1:]]


def test_each_round_is_divided_by_the_same_rounds_peer_and_the_median_given(tmp_path: Path) -> None:
    table = ratio_table(read_figures(write(tmp_path, ROWS)))
    assert table.splitlines()[0] == "| l3worker / peer | llama | vllm |"
    # TPOT: round 1 9.0 / 10.0 and 9.0 / 20.0; round 2 9.9 / 9.0 and 9.9 / 22.0
    assert cells(table, "1 client: TPOT p50") == ["0.90, 1.10 (median 1.00)", "0.45, 0.45 (median 0.45)"]
    assert cells(table, "launch to /health 200") == ["20.00, 20.00 (median 20.00)", "0.20, 0.20 (median 0.20)"]


def test_a_missing_figure_or_load_leaves_its_cell_without_that_round(tmp_path: Path) -> None:
    table = ratio_table(read_figures(write(tmp_path, ROWS)))
    assert cells(table, "16 clients, repeated prompts: output tok/s") == ["-", "2.00"]  # llama's tok/s is empty
    assert cells(table, "16 clients, repeated prompts: TPOT p50") == ["0.50", "0.45"]  # round 1 only
    assert "| 16 clients, fresh prompts:" not in table  # no c16new load ran: no row


def test_bad_figures_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="figures.tsv:1: 3 fields, expected 11"):
        read_figures(write(tmp_path, [("l3worker", 1, "c1")]))
    with pytest.raises(ValueError, match="no l3worker rows"):
        ratio_table(read_figures(write(tmp_path, [r for r in ROWS if r[0] != "l3worker"])))
    with pytest.raises(ValueError, match="no peer rows"):
        ratio_table(read_figures(write(tmp_path, [r for r in ROWS if r[0] == "l3worker"])))


def test_the_command_line_prints_the_table(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), str(write(tmp_path, ROWS))], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("| l3worker / peer | llama | vllm |\n| --- | ---: | ---: |\n")
    assert "| 1 client: TTFT p50 | 0.80, 0.79 (median 0.80) | 0.50, 0.56 (median 0.53) |" in out


def test_an_l3worker_variant_gets_its_own_table_against_the_peers_alone(tmp_path: Path) -> None:
    rows = ROWS + [("l3worker-si4", 1, "c1", 110, 80, 8.0, 30, 0, 10.0), ("l3worker-si4", 2, "c1", 100, 84, 8.1, 31,
                                                                          0, 10.0)]
    figures = read_figures(write(tmp_path, rows))
    assert variants(figures) == ["l3worker", "l3worker-si4"]
    table = ratio_table(figures, "l3worker-si4")
    assert table.splitlines()[0] == "| l3worker-si4 / peer | llama | vllm |"  # l3worker is no peer of its variant
    assert cells(table, "1 client: TPOT p50") == ["0.80, 0.90 (median 0.85)", "0.40, 0.37 (median 0.38)"]
    assert ratio_table(figures).splitlines()[0] == "| l3worker / peer | llama | vllm |"
    out = subprocess.run([sys.executable, str(SCRIPT), str(write(tmp_path, rows))], capture_output=True, text=True,
                         check=True).stdout
    assert out.index("| l3worker / peer |") < out.index("| l3worker-si4 / peer |")


def test_the_rows_from_the_runs_duration_count_each_request_as_its_output_length(tmp_path: Path) -> None:
    # the peer's tok/s and TPOT are off (its text tokenized again); request throughput is not
    rows = [("l3worker", 1, "c1", 50, 100, 20.0, 30, 0, 10.0, 0.4, 128),  # 2,500 ms a request
            ("llama", 1, "c1", 400, 150, 2.0, 25, 0, 0.5, 0.5, 128),  # 2,000 ms a request
            ("l3worker", 1, "c16new", 200, 900, 60.0, 90, 0, 10.0, 1.6, 128),
            ("llama", 1, "c16new", 1600, 1200, 8.0, 80, 0, 0.5, 1.2, 128)]
    table = ratio_table(read_figures(write(tmp_path, rows)))
    # (2500 - 100) / 127 = 18.90 ms against (2000 - 150) / 127 = 14.57 ms
    assert cells(table, "1 client: time a token, from the run's duration") == [f"{2400 / 1850:.2f}"]
    assert cells(table, "16 clients, fresh prompts: output tok/s, from the run's duration") == ["1.33"]
    assert cells(table, "16 clients, fresh prompts: output tok/s") == ["0.12"]  # the client's own count
    older = read_figures(write(tmp_path, [r[:9] for r in rows]))  # figures from before the two columns
    assert "token_ms_by_duration" not in older[("l3worker", "1", "c1")]
    assert "from the run's duration" not in ratio_table(older)
