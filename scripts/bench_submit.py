#!/usr/bin/env python
"""Prompt submission cost: handing a prompt to DistributedWorker as a Python list vs an int32 array.

Times the worker's input path, `w.engine.make_request(prompt, SamplingParams(max_new_tokens=1), ...)`:
validation and conversion to the int32 ids the staging buffer takes, with nothing sent (the worker
is never prepared, so no child starts). Used by bench_decode.py; runs alone too:

    python scripts/bench_submit.py MODEL_DIR [--sizes 128,1024,16384]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from l3worker import DistributedWorker, SamplingParams

DEFAULT_SIZES = (128, 1024, 4096, 16384)


def _per_call_s(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure_submission(model_dir: str, sizes: tuple[int, ...] = DEFAULT_SIZES, rounds: int = 7,
                       seed: int = 0) -> dict:
    """Per token count: median over `rounds` of the per-call time for a list and for an int32 array
    (the two alternate within a round), and list/array."""
    w = DistributedWorker(model_dir, device="cpu", max_batch_size=1, max_seq_len=max(sizes) + 1)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    vocab = w.model_config.vocab_size
    rng = np.random.default_rng(seed)
    rows = []
    try:
        for n in sizes:
            array = rng.integers(0, vocab, n).astype(np.int32)
            as_list = array.tolist()
            for prompt in (array, as_list):  # both paths must accept the prompt and agree
                state = w.engine.make_request(prompt, params, None, False, "prompt")
                assert np.array_equal(state.prompt_ids, array)
            calls = max(5, 200_000 // n)
            list_s, array_s = [], []
            for _ in range(rounds):
                list_s.append(_per_call_s(lambda p=as_list: w.engine.make_request(p, params, None, False, "prompt"), calls))
                array_s.append(_per_call_s(lambda p=array: w.engine.make_request(p, params, None, False, "prompt"), calls))
            lst, arr = statistics.median(list_s), statistics.median(array_s)
            rows.append({"tokens": n, "list_s": lst, "array_s": arr, "ratio": lst / arr, "calls_per_round": calls,
                         "rounds": rounds})
    finally:
        w.close()
    return {"method": "Engine.make_request(prompt, SamplingParams(max_new_tokens=1), ...): "
                      "median over rounds of the mean per-call time", "sizes": rows}


def format_submission(result: dict) -> str:
    lines = ["| prompt tokens | list (us) | int32 array (us) | list / array |", "| ---: | ---: | ---: | ---: |"]
    for r in result["sizes"]:
        lines.append(f"| {r['tokens']} | {r['list_s'] * 1e6:.1f} | {r['array_s'] * 1e6:.1f} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated token counts")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    result = measure_submission(args.model_dir, tuple(int(s) for s in args.sizes.split(",")))
    print(format_submission(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
