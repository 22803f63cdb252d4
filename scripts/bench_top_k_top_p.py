#!/usr/bin/env python
"""What the sampler (chip_child.sampling.sampler.sample) costs on the cpu at a vocabulary of your
choosing (default: Qwen3's 151,936): greedy, temperature alone, and with top-k and top-p.

Logits are random and peaked (normal, times 4): at temperature 0.6 and top_p 0.95 a row keeps
tens of tokens, as a trained model's row does. `wide` rows (times 0.05) keep most of the
vocabulary under top_p, which is a cpu's slow case (a full sort a row). Variants, alternated
within each round:

  greedy         temperature 0: the argmax alone
  temperature    temperature 1.0, no filter
  qwen3          temperature 0.6, top_k 20, top_p 0.95 (Qwen3's generation_config.json)
  top_k          temperature 1.0, top_k 40
  top_p          temperature 0.6, top_p 0.95
  top_p_wide     temperature 1.0, top_p 0.95 on the wide rows

    python scripts/bench_top_k_top_p.py                      # batch 1 and 16, one thread
    python scripts/bench_top_k_top_p.py --against HEAD~1     # each variant against a past version

--against REV runs the sampler as it was at git revision REV (its chip_child, from `git archive`)
in processes alternated with the working tree's, and prints each one's p50 and the ratio; it also
says whether the two drew the same tokens, and how many differ. Against a revision before the
noise fix of 2026-11-30 some do: there a token whose noise came out as 1.0 was drawn whatever its
logit, about one draw in 110 at this vocabulary. Timings are not checked: compare ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # temperature, top_k, top_p, logit scale
    "greedy": (0.0, 0, 1.0, 4.0),
    "temperature": (1.0, 0, 1.0, 4.0),
    "qwen3": (0.6, 20, 0.95, 4.0),
    "top_k": (1.0, 40, 1.0, 4.0),
    "top_p": (0.6, 0, 0.95, 4.0),
    "top_p_wide": (1.0, 0, 0.95, 0.05),
}


def measure(vocab: int, batch: int, calls: int) -> dict:
    """{variant: [p50 seconds, sampled ids]} in this process, with the chip_child on sys.path."""
    import torch

    from chip_child.sampling.noise import vocab_hash
    from chip_child.sampling.sampler import sample, seed_key

    g = torch.Generator().manual_seed(0)
    base = torch.randn(batch, vocab, generator=g)
    keys = torch.tensor([seed_key(i) for i in range(batch)])
    vocab_keys, out = vocab_hash(vocab, torch.device("cpu")), {}
    with torch.inference_mode():
        for name, (temperature, top_k, top_p, scale) in VARIANTS.items():
            logits = base * scale
            t, k, p = (torch.full((batch,), v) for v in (temperature, top_k, top_p))
            times, ids = [], []
            for call in range(calls):
                counters = torch.full((batch,), 100 + call)
                t0 = time.perf_counter()
                picked = sample(logits, t, k.long(), p, keys, counters, vocab_keys, temperature > 0,
                                top_k > 0 or top_p < 1)
                times.append(time.perf_counter() - t0)
                ids.append(picked.tolist())
            out[name] = [statistics.median(times), ids]
    return out


def _worker(tree: str, vocab: int, batch: int, calls: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(ROOT / "scripts")]))
    code = (f"import json, torch; torch.set_num_threads({threads}); import bench_top_k_top_p as b; "
            f"import chip_child; assert chip_child.__file__.startswith({tree!r}), chip_child.__file__; "
            f"print(json.dumps(b.measure({vocab}, {batch}, {calls})))")
    # In `tree` (python -c puts the working directory first on sys.path): its chip_child, not ours.
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def _differing(a: list[list[int]], b: list[list[int]]) -> str:
    pairs = [(x, y) for call_a, call_b in zip(a, b) for x, y in zip(call_a, call_b)]
    return f"{sum(x != y for x, y in pairs)} of {len(pairs)}"


def _tree_at(rev: str, into: str) -> str:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "chip_child"], capture_output=True, check=True)
    with tempfile.TemporaryFile() as f:
        f.write(archive.stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", default="1,16", help="comma-separated row counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (each a fresh process per tree)")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per variant per round")
    ap.add_argument("--against", metavar="REV", help="a git revision to time the sampler of, alternated")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-top-k-top-p-") as tmp:
        trees = {"this tree": str(ROOT)}
        if args.against:
            trees[args.against] = _tree_at(args.against, tmp)
        for batch in batches:
            p50s = {tree: {v: [] for v in VARIANTS} for tree in trees}
            ids: dict[str, dict] = {}
            for _ in range(args.rounds):
                for tree, path in trees.items():
                    result = _worker(path, args.vocab, batch, args.calls, args.threads)
                    for v, (p50, drawn) in result.items():
                        p50s[tree][v].append(p50)
                        ids.setdefault(tree, {})[v] = drawn
            print(f"\nvocab {args.vocab}, batch {batch}, {args.threads} thread(s), {args.rounds} rounds, "
                  f"median of per-round p50s (ms):")
            names = list(trees)
            head = " | ".join(names) + (f" | {names[0]} / {names[1]}" if len(names) == 2 else "")
            print(f"| variant | {head} |\n|---|" + "---:|" * (len(names) + (len(names) == 2)))
            for v in VARIANTS:
                ms = [statistics.median(p50s[t][v]) * 1e3 for t in names]
                cells = [f"{m:.3f}" for m in ms] + ([f"{ms[0] / ms[1]:.2f}"] if len(ms) == 2 else [])
                print(f"| {v} | " + " | ".join(cells) + " |")
            if len(names) == 2:
                print(f"tokens differing from {names[1]}'s: " + ", ".join(
                    f"{v} {_differing(ids[names[0]][v], ids[names[1]][v])}" for v in VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
