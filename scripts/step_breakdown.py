"""Where a run's step time goes, from its step records (l3worker.engine.stats.StepRecord as dicts):
a served run's (`L3WORKER_STEP_TRACE`, written by the engine core) or an offline one's
(DistributedWorker.step_records()). scripts/bench_serve.py --step-trace prints both side by side.

    python scripts/step_breakdown.py served_steps.json [offline_steps.json]

For each run: decode-only steps (no prompt tokens) and their child time against the period the
parent saw; the steps whose period was over 2x the median decode-only period, and what they
carried (prompt tokens, rows, whether the child's own time was long too, that is computing rather
than waiting for a core); the child's cost per prompt token; preemptions.
"""
from __future__ import annotations

import json
import sys

import numpy as np

SLOW = 2.0  # a step is slow past this many median decode-only periods


def _dist(values, scale: float = 1.0) -> dict:
    """Count, median, p99 and max of `values` times `scale`."""
    if not len(values):
        return {"n": 0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"n": len(a), "p50": round(float(np.median(a)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "max": round(float(a.max()), 2)}


def breakdown(steps: list[dict]) -> dict:
    steps = steps[1:]  # the first period runs from the worker's start, not from a step
    decode = [s for s in steps if not s.get("prefill_tokens")]
    prefill = [s for s in steps if s.get("prefill_tokens")]
    median = float(np.median([s["parent_wall_s"] for s in decode])) if decode else 0.0
    slow = [s for s in steps if median and s["parent_wall_s"] > SLOW * median]
    child_median = float(np.median([s["apply_s"] for s in decode])) if decode else 0.0
    per_token = [(s["apply_s"] - child_median) / s["prefill_tokens"] for s in prefill]
    wall = sum(s["parent_wall_s"] for s in steps)
    return {
        "steps": len(steps),
        "wall_s": round(wall, 3),
        "child_busy_fraction": round(sum(s["apply_s"] for s in steps) / wall, 3) if wall else None,
        "decode_period_ms": _dist([s["parent_wall_s"] for s in decode], 1e3),
        "decode_child_ms": _dist([s["apply_s"] for s in decode], 1e3),
        "decode_rows_mean": round(float(np.mean([s["rows"] for s in decode])), 2) if decode else None,
        "prefill_period_ms": _dist([s["parent_wall_s"] for s in prefill], 1e3),
        "prefill_tokens_per_step": _dist([s["prefill_tokens"] for s in prefill]),
        "child_ms_per_prompt_token": round(float(np.median(per_token)) * 1e3, 3) if per_token else None,
        "slow_steps": len(slow),
        "slow_with_prompt_tokens": sum(1 for s in slow if s.get("prefill_tokens")),
        "slow_with_long_child_time": sum(1 for s in slow if s["apply_s"] > SLOW * child_median),
        "slow_prompt_tokens": _dist([s["prefill_tokens"] for s in slow]),
        "slow_rows": _dist([s["rows"] for s in slow]),
        "preemptions": (steps[-1].get("preemptions", 0) - steps[0].get("preemptions", 0)) if steps else 0,
    }


def print_breakdowns(named: dict[str, list[dict]]) -> None:
    rows = {name: breakdown(steps) for name, steps in named.items()}
    keys = list(next(iter(rows.values())))
    print(f"{'step breakdown':<34}" + "".join(f"{n:>34}" for n in rows))
    for key in keys:
        cells = []
        for r in rows.values():
            v = r[key]
            if isinstance(v, dict):
                v = " ".join(f"{k}={x}" for k, x in v.items())
            cells.append(f"{str(v):>34}")
        print(f"{key:<34}" + "".join(cells))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    named = {}
    for path in argv:
        with open(path) as f:
            named[path.rsplit("/", 1)[-1]] = json.load(f)
    print_breakdowns(named)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
