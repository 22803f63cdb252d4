#!/usr/bin/env python
"""l3worker's served figures over each peer's, round by round, from the tab-separated figures that
scripts/bench_served_peers.sh writes (PEERS_BUILD/served/figures.tsv; it runs this at its end).

    python scripts/served_ratios.py PEERS_BUILD/served/figures.tsv

A row per figure, a column per peer; each cell gives every round's ratio (l3worker / peer, from the
same round) and their median. Throughput is better above 1, the times below 1. A figure that a
round lacks (a load whose client failed, an engine that was not run) is left out of that cell, and
a figure no round has, its row.
The rows "from the run's duration" count each request as the output length it asked for (the
client's --ignore-eos): they stay right where the client's own token count is off, as when it
tokenizes a peer's text again with a tokenizer that does not give back the same tokens. At one
client that row is the time a token, (the run's duration / requests - TTFT p50) / (output length - 1).
Each l3worker variant the run had (an engine named l3worker-si4: `--stream-interval 4`) gets a
table of its own against the same peers.
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

COLUMNS = ("engine", "round", "load", "output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "p99_itl_ms", "failed",
           "launch_s", "req_s", "output_len")
OLDER_COLUMNS = COLUMNS[:9]  # figures written before the driver gave request throughput and output length
FIGURES = (  # (load, column, label)
    ("c1", "ttft_p50_ms", "1 client: TTFT p50"),
    ("c1", "tpot_p50_ms", "1 client: TPOT p50"),
    ("c1", "p99_itl_ms", "1 client: P99 ITL"),
    ("c16rep", "output_tok_s", "16 clients, repeated prompts: output tok/s"),
    ("c16rep", "tpot_p50_ms", "16 clients, repeated prompts: TPOT p50"),
    ("c16rep", "p99_itl_ms", "16 clients, repeated prompts: P99 ITL"),
    ("c16new", "output_tok_s", "16 clients, fresh prompts: output tok/s"),
    ("c16new", "ttft_p50_ms", "16 clients, fresh prompts: TTFT p50"),
    ("c16new", "tpot_p50_ms", "16 clients, fresh prompts: TPOT p50"),
    ("c16new", "p99_itl_ms", "16 clients, fresh prompts: P99 ITL"),
    ("c1", "token_ms_by_duration", "1 client: time a token, from the run's duration"),
    ("c16rep", "req_s", "16 clients, repeated prompts: output tok/s, from the run's duration"),
    ("c16new", "req_s", "16 clients, fresh prompts: output tok/s, from the run's duration"),
    ("c1", "launch_s", "launch to /health 200"),
)
OURS = "l3worker"


def read_figures(path: Path) -> dict[tuple[str, str, str], dict[str, float]]:
    """{(engine, round, load): {column: value}}; empty or unparsable cells are left out."""
    figures: dict[tuple[str, str, str], dict[str, float]] = {}
    with path.open(newline="") as f:
        for line, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if len(row) not in (len(COLUMNS), len(OLDER_COLUMNS)):
                raise ValueError(f"{path}:{line}: {len(row)} fields, expected {len(COLUMNS)} ({', '.join(COLUMNS)})")
            fields = dict(zip(COLUMNS, row))
            values = {}
            for name in COLUMNS[3:len(row)]:
                try:
                    values[name] = float(fields[name])
                except ValueError:
                    continue
            if values.get("req_s") and values.get("output_len", 0) > 1 and "ttft_p50_ms" in values:
                # one request after another at one client: a request's time is 1 / req_s
                per_request_ms = 1000 / values["req_s"]
                values["token_ms_by_duration"] = (per_request_ms - values["ttft_p50_ms"]) / (values["output_len"] - 1)
            figures[(fields["engine"], fields["round"], fields["load"])] = values
    return figures


def variants(figures: dict[tuple[str, str, str], dict[str, float]]) -> list[str]:
    """The l3worker engines of the run: l3worker, then its variants (l3worker-si4, ...) by name."""
    return sorted({e for e, _, _ in figures if e == OURS or e.startswith(OURS + "-")}, key=lambda e: (e != OURS, e))


def ratio_table(figures: dict[tuple[str, str, str], dict[str, float]], ours: str = OURS) -> str:
    """The markdown table of `ours` (l3worker or one of its variants) / peer per figure and round."""
    engines = sorted({engine for engine, _, _ in figures})
    if ours not in engines:
        raise ValueError(f"no {ours} rows among the engines {engines}")
    peers = [e for e in engines if e not in variants(figures)]
    if not peers:
        raise ValueError(f"no peer rows beside {ours}'s")
    rounds = sorted({r for _, r, _ in figures}, key=int)
    lines = [f"| {ours} / peer | " + " | ".join(peers) + " |", "| --- |" + " ---: |" * len(peers)]
    for load, column, label in FIGURES:
        cells = []
        for peer in peers:
            ratios: dict[str, float] = {}
            for r in rounds:
                mine = figures.get((ours, r, load), {}).get(column)
                theirs = figures.get((peer, r, load), {}).get(column)
                if mine is not None and theirs:
                    ratios[r] = mine / theirs
            if not ratios:
                cells.append("-")
                continue
            each = ", ".join(f"{ratios[r]:.2f}" for r in rounds if r in ratios)
            cells.append(each if len(ratios) == 1 else f"{each} (median {statistics.median(ratios.values()):.2f})")
        if any(cell != "-" for cell in cells):  # a load the run left out (LOADS) gets no row
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("figures", type=Path, help="the figures.tsv of scripts/bench_served_peers.sh")
    figures = read_figures(p.parse_args().figures)
    print("\n\n".join(ratio_table(figures, ours) for ours in variants(figures) or [OURS]))


if __name__ == "__main__":
    main()
