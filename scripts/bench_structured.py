"""What a constrained row costs: decode step time of a batch of 16 with 0, 1 and 16 rows under a JSON
schema (same model, same prompts), and a typical schema's compile time, first and cached.

    PYTHONPATH=$PWD python scripts/bench_structured.py [--model DIR] [--device auto] [--steps 64] [--repeats 3]

The schema's string must be at least 400 characters long, so no row's grammar ends during the
run and the batch stays full. Step times are the parent's wall time per decode step (what every
row's TPOT is) and the child's apply and device times, medians over the run, each variant's best
of --repeats runs, the variants alternated; the machine is shared: compare ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_common import machine_info

from chip_child.models.tiny_model import ensure_tiny_model
from l3worker import DistributedWorker, SamplingParams
from l3worker.structured.request_grammars import ParentGrammars
from l3worker.structured.specs import StructuredSpec

LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}
TYPICAL = {  # the compile figure's schema: a user record of seven properties
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
        "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
        "score": {"type": "number"}, "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "roles", "address", "score", "active"],
}


def step_times(worker: DistributedWorker, constrained: int, steps: int) -> dict[str, float]:
    batch = 16
    prompts = [f"Request {i}: write a long text." for i in range(batch)]
    params = [SamplingParams(max_new_tokens=steps, temperature=1.0, seed=i, ignore_eos=True,
                             structured_outputs={"json": LONG} if i < constrained else None) for i in range(batch)]
    worker.generate(prompts, params)
    decode = [s for s in worker._last.steps if not s.prefill][2:]  # the first steps still admit rows
    return {"parent_wall_ms": 1e3 * statistics.median(s.parent_wall_s for s in decode),
            "apply_ms": 1e3 * statistics.median(s.apply_s for s in decode),
            "device_ms": 1e3 * statistics.median(s.device_s for s in decode),
            "h2d_bytes": statistics.median(s.h2d_bytes for s in decode)}


def compile_times(model_dir: Path, vocab_size: int, eos: tuple[int, ...]) -> dict[str, float]:
    grammars = ParentGrammars(model_dir, vocab_size, eos)
    t0 = time.perf_counter()
    grammars.submit(StructuredSpec.of({"json": {"type": "boolean"}})).result()
    tokenizer_s = time.perf_counter() - t0  # the token trie, once per process (plus a trivial compile)
    spec = StructuredSpec.of({"json": TYPICAL})
    t0 = time.perf_counter()
    grammars.submit(spec).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.submit(spec).result()
    cached = time.perf_counter() - t0
    grammars.close()
    return {"tokenizer_s": tokenizer_s, "first_ms": first * 1e3, "cached_us": cached * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = Path(args.model) if args.model else ensure_tiny_model()
    print(json.dumps(machine_info(model=str(model), device=args.device)))
    results: dict[int, list[dict[str, float]]] = {0: [], 1: [], 16: []}
    with DistributedWorker(str(model), device=args.device, max_batch_size=16, max_seq_len=1024, page_size=16) as w:
        step_times(w, 16, 8)  # warms the compile caches and the batch
        for _ in range(args.repeats):
            for constrained in results:
                results[constrained].append(step_times(w, constrained, args.steps))
        cfg = w.engine.model_config
        compiled = compile_times(model, cfg.vocab_size, cfg.eos_token_ids)
    base = min(r["parent_wall_ms"] for r in results[0])
    for constrained, runs in results.items():
        best = min(runs, key=lambda r: r["parent_wall_ms"])
        print(f"constrained rows {constrained:2d}/16: step {best['parent_wall_ms']:.2f} ms "
              f"({best['parent_wall_ms'] / base:.2f}x), child apply {best['apply_ms']:.2f} ms, "
              f"device {best['device_ms']:.2f} ms, h2d {best['h2d_bytes']:.0f} B")
    print(f"compile: tokenizer trie {compiled['tokenizer_s']:.2f} s once; typical schema first "
          f"{compiled['first_ms']:.2f} ms, cached {compiled['cached_us']:.1f} us")


if __name__ == "__main__":
    main()
