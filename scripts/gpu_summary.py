#!/usr/bin/env python
"""The summary table of scripts/gpu_check.sh: reads what each of its steps left in one folder
(pytest's JUnit XML, bench_gpu's and bench_serve's JSON, the fp8, speculation and KV-cache
figures as printed) and prints one Markdown table, a row per figure, with the step's exit status.

    python scripts/gpu_summary.py OUT/gpu_check
"""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def status(folder: Path, name: str) -> str:
    rc = folder / f"{name}.rc"
    if not rc.exists():
        return "not run"
    code = rc.read_text().strip()
    return "ok" if code == "0" else "timed out" if code in ("124", "137") else f"exit {code}"


def tests_rows(folder: Path) -> list[tuple[str, str]]:
    xml = folder / "tests.xml"
    if not xml.exists():
        return [("tests", "no JUnit report")]
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return [("tests passed / failed / skipped", f"{n - failed - skipped} / {failed} / {skipped}")]


def decode_rows(folder: Path) -> list[tuple[str, str]]:
    path = folder / "decode.json"
    if not path.exists():
        return [("decode step", "no result")]
    rows = []
    for model, res in json.loads(path.read_text())["models"].items():
        for batch, row in res["batches"].items():
            v = row["variants"]
            if "l3" in v:
                rows.append((f"decode {model} batch {batch}: l3 step / byte roofline",
                             f"{v['l3']['step_s'] * 1e3:.3f} ms / {row['roofline_s'] * 1e3:.3f} ms "
                             f"= {v['l3']['x_roofline']:.2f}x"))
            if "l3" in v and "floor" in v:
                rows.append((f"decode {model} batch {batch}: l3 / in-process floor",
                             f"{v['l3']['step_s'] / v['floor']['step_s']:.3f}"))
            if "hf_static" in v and "l3" in v:
                rows.append((f"decode {model} batch {batch}: transformers static / l3",
                             f"{v['hf_static']['step_s'] / v['l3']['step_s']:.2f}"))
    return rows


def printed_rows(folder: Path, name: str, pattern: str, label: str) -> list[tuple[str, str]]:
    """Lines of a step's log that match `pattern`, one row each, as printed."""
    log = folder / f"{name}.log"
    lines = [ln.strip() for ln in log.read_text().splitlines() if re.search(pattern, ln)] if log.exists() else []
    return [(label, " ".join(ln.split())) for ln in lines] or [(label, "no figures")]


def serve_rows(folder: Path) -> list[tuple[str, str]]:
    path = folder / "serve.json"
    if not path.exists():
        return [("served", "no result")]
    result = json.loads(path.read_text())
    served, rows = result["served"], []
    rows.append(("served: output tok/s, failed requests", f"{served['output_throughput']:.1f}, {served['failed']}"))
    if result.get("offline"):
        rows.append(("offline: output tok/s", f"{result['offline']['output_throughput_tok_per_s']:.1f}"))
    if "ratios" in result:
        rows.append(("served TPOT p50 / offline TPOT p50",
                     f"{result['ratios']['tpot_p50_over_offline_tpot_p50_median']:.3f}"))
    return rows


def main(folder: Path) -> int:
    sections = [
        ("tests", tests_rows(folder)),
        ("decode", decode_rows(folder)),
        ("fp8", printed_rows(folder, "fp8", r"^\s*\d+\s+[\d.]+\s+[\d.]+", "fp8 vs bf16 (batch, bf16 ms, fp8 ms, "
                             "dequant ms, fp8/bf16, tokens = dequant)")),
        ("spec", printed_rows(folder, "spec", r"^\S+\s+(ngram|draft_self|eagle_random)\s", "speculation (model, "
                              "method, workload, batch, plain tok/s, spec tok/s, ratio, accept, mean len)")),
        ("serve", serve_rows(folder)),
        ("kv_offload", printed_rows(folder, "kv_offload", r"recompute .* host tier", "second-round TTFT, host tier "
                                    "against recompute")),
        ("kv_fp8", printed_rows(folder, "kv_fp8", r"top-1|capacity|^decode", "fp8 KV cache against the model "
                                "dtype's")),
    ]
    print("| step | status | figure | value |\n| --- | --- | --- | --- |")
    for name, rows in sections:
        for label, value in rows:
            print(f"| {name} | {status(folder, name)} | {label} | {value} |")
    return 0 if all(status(folder, name) == "ok" for name, _ in sections) else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
