#!/usr/bin/env python
"""Block FP8 (W8A8) against bf16: the decode step of a random Qwen3-8B-shaped checkpoint.

One random bf16 checkpoint (scripts/bench_gpu.write_checkpoint); per batch size the median decode
step (ChipRuntime.execute in a loop, decode graphs on, as bench_gpu's `floor`) of:

  bf16          the checkpoint as it is
  fp8           quantization="fp8": the projections quantized per 128 x 128 block at load; on
                cuda kept fp8 and run W8A8 (chip_child.models.fp8_linear; the GEMM it chose is printed),
                elsewhere dequantized at load (then it is the bf16 step on other weights)
  fp8_dequant   the same fp8 weights dequantized at load to bf16 (the reference of the weights:
                bf16 activations), whose tokens the fp8 run's are compared with

Printed per batch: step ms of each, fp8 / bf16, and the fraction of fp8's greedy tokens equal to
fp8_dequant's (W8A8 also quantizes the activations per 128 columns, so the tokens may part where
two logits are close; random weights make that common, so it is a figure, not a check).

    python scripts/bench_fp8.py                                    # 8b, batch 1, 16, 64
    python scripts/bench_fp8.py --device cpu --models tiny --batches 2 --prompt-len 8 --new-tokens 4   # smoke
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere

import numpy as np  # noqa: E402
from bench_common import random_prompts  # noqa: E402  (scripts/, next to this file)
from bench_gpu import SHAPES, Floor, free_device, write_checkpoint  # noqa: E402

from chip_child.step import runtime as runtime_module  # noqa: E402
from chip_child.models.fp8_linear import W8A8_ENV, Fp8Linear  # noqa: E402

VARIANTS = ("bf16", "fp8", "fp8_dequant")


def held(floor: Floor) -> str:
    """What the runtime's projections are: 'w8a8 (<gemm>)' or 'plain'."""
    qkv = floor.rt.weights.layers[0].qkv
    return f"w8a8 ({qkv.gemm})" if isinstance(qkv, Fp8Linear) else "plain"


def make_floor(variant: str, model_dir: str, args, max_batch: int) -> Floor:
    if variant == "fp8_dequant":  # the loader's decision overridden: dequantize at load on any device
        keep = runtime_module.keeps_fp8_on
        runtime_module.keeps_fp8_on = lambda device, quant: False
        try:
            return Floor(model_dir, args, max_batch, quantization="fp8")
        finally:
            runtime_module.keeps_fp8_on = keep
    os.environ[W8A8_ENV] = "1"  # the W8A8 path is opt-in (chip_child.models.fp8_linear)
    return Floor(model_dir, args, max_batch, quantization=None if variant == "bf16" else "fp8")


def bench(name: str, args) -> None:
    shape = SHAPES[name]
    max_batch = max(args.batches)
    prompts = {(b, r): random_prompts(b, args.prompt_len, shape.vocab_size, seed=1000 * b + r)
               for b in args.batches for r in range(args.repeats)}
    times: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-fp8-{name}-") as tmp:
        write_checkpoint(Path(tmp), shape, args.device)
        for variant in VARIANTS:
            floor = make_floor(variant, tmp, args, max_batch)
            print(f"[{name}] {variant}: projections {held(floor)}", flush=True)
            for b in args.batches:
                for r in range(args.repeats):
                    step_s, toks = floor.run(prompts[b, r], True)
                    times.setdefault((variant, b), []).append(float(np.median(step_s)))
                    tokens.setdefault((variant, b), toks)
            floor.close()
            del floor
            free_device(args.device)
    print(f"\n{name}: median decode step (ms), prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"{'batch':>5} {'bf16':>8} {'fp8':>8} {'fp8_dequant':>11} {'fp8/bf16':>8} {'tokens=dequant':>14}")
    for b in args.batches:
        ms = {v: 1e3 * statistics.median(times[v, b]) for v in VARIANTS}
        same = float(np.mean(tokens["fp8", b] == tokens["fp8_dequant", b]))
        print(f"{b:>5} {ms['bf16']:>8.2f} {ms['fp8']:>8.2f} {ms['fp8_dequant']:>11.2f} "
              f"{ms['fp8'] / ms['bf16']:>8.2f} {same:>14.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="8b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    for name in args.models.split(","):
        bench(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
