#!/usr/bin/env python
"""Speculative decoding against plain decoding on the cpu, through DistributedWorker.

Workers on the same model, one plain and one per method, are prepared once; each repeat runs
every (workload, batch) case on each, alternating, and takes tokens/s of generated tokens over
the generate() wall time. Methods (`--methods`): `ngram` (k drafts by prompt lookup, 2..4) and
`draft_self` (draft_model with the target itself as the draft: every draft is accepted, so it is
the upper bound of acceptance, at the cost of k draft forwards a step) and `eagle_random` (eagle3
with a random head of the target's shape: drafts almost never accepted, so its ratio is the cost
of verifying k + 1 tokens a row and running the head). Workloads:

  repetitive      greedy, prompts that are a story repeated (editing or summarising a given text:
                  the answer copies long runs of its input)
  non-repetitive  seeded sampling at temperature 1.0 from random prompts: drafts rarely match

Models: `story` (the built-in trained story model: real text, a tiny step where per-step work
dominates) and `compute` (a random Qwen3 of about 58M parameters: the weights dominate a step, as
on a real model). Reports per case the median tokens/s of each variant, their ratio
(speculative / plain, from the same run), the acceptance rate and mean accepted length, and
whether the tokens were identical (exit status 1 if not). Timings are not checked: compare
ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from bench_common import machine_info  # scripts/, next to this file
from bench_models import write_random_eagle3_head, write_random_qwen3  # scripts/, next to this file

from chip_child.models.loader import load_config
from l3worker import DistributedWorker, SamplingParams

COMPUTE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
               eos_token_id=None, bos_token_id=None)
STORY = ("Once upon a time there was a little fox who lived in the forest. Every morning the fox "
         "walked to the river to drink, and every evening it walked home again. ")


def prompts_for(workload: str, batch: int, tokenizer, vocab: int) -> tuple[list, list[SamplingParams]]:
    if workload == "repetitive":
        text = STORY * 3
        ids = tokenizer.encode(text).ids if tokenizer is not None else (list(range(5, 37)) * 6)
        prompts = [list(ids) for _ in range(batch)]
        params = [SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=0.0, ignore_eos=True)] * batch
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(5, vocab, 96).tolist() for _ in range(batch)]
        params = [SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
                  for i in range(batch)]
    return prompts, params


def run_case(worker: DistributedWorker, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = worker.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in tokens) / wall, tokens


def random_head(model_dir: str, head: Path) -> str:
    """A random EAGLE-3 head shaped like one layer of the target, written to `head`."""
    c = load_config(model_dir)
    write_random_eagle3_head(head, c.hidden_size, c.vocab_size, min(c.vocab_size, 32000), c.num_heads,
                             c.num_kv_heads, c.head_dim, c.intermediate_size)
    return str(head)


def bench_model(name: str, model_dir: str | None, tmp: str) -> tuple[list[dict], bool]:
    common = dict(device="cpu", max_batch_size=max(ARGS.batches), max_seq_len=1024, page_size=64)
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": ARGS.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4},
               "draft_self": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": ARGS.k}}
    if "eagle_random" in ARGS.methods:
        head = random_head(model_dir, Path(tmp) / f"{name}-eagle3")
        configs["eagle_random"] = {"method": "eagle3", "model": head, "num_speculative_tokens": ARGS.k}
    rows, same = [], True
    with ExitStack() as stack:
        plain = stack.enter_context(DistributedWorker(model_dir, **common))
        workers = {m: stack.enter_context(DistributedWorker(model_dir, **common, speculative_config=configs[m]))
                   for m in ARGS.methods}
        tokenizer = plain.tokenizer if name == "story" else None
        vocab = plain.model_config.vocab_size
        cases = [(w, b) for w in ("repetitive", "non-repetitive") for b in ARGS.batches]
        rates = {(c, v): [] for c in cases for v in ("plain", *workers)}
        accept = {(c, m): [] for c in cases for m in workers}
        for case in cases:  # warm: the first generate of each shape pays one-time costs
            for w in (plain, *workers.values()):
                run_case(w, *prompts_for(*case, tokenizer, vocab))
        for _ in range(ARGS.repeats):
            for case in cases:
                prompts, params = prompts_for(*case, tokenizer, vocab)
                r_plain, t_plain = run_case(plain, prompts, params)
                rates[case, "plain"].append(r_plain)
                for m, w in workers.items():
                    before = dict(w.engine.speculation.summary())
                    r_spec, t_spec = run_case(w, prompts, params)
                    after = w.engine.speculation.summary()
                    same &= t_plain == t_spec
                    rates[case, m].append(r_spec)
                    accept[case, m].append(tuple(after[f] - before[f] for f in
                                                 ("num_drafts", "num_draft_tokens", "num_accepted_tokens")))
        for case in cases:
            p = statistics.median(rates[case, "plain"])
            for m in workers:
                s = statistics.median(rates[case, m])
                drafts, tokens, accepted = (sum(x[i] for x in accept[case, m]) for i in range(3))
                rows.append({"model": name, "method": m, "workload": case[0], "batch": case[1],
                             "plain_tok_s": round(p, 1), "spec_tok_s": round(s, 1), "ratio": round(s / p, 2),
                             "acceptance": round(accepted / tokens, 3) if tokens else None,
                             "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
                             # No draft was proposed: the same steps as plain decoding plus the proposer's
                             # lookups, so a ratio away from 1 is the machine's noise, not a speed-up.
                             "noise_only": not drafts})
    return rows, same


def main() -> int:
    info = machine_info(k=ARGS.k, new_tokens=ARGS.new_tokens, repeats=ARGS.repeats)
    print(json.dumps(info))
    all_rows, same = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARGS.models:
            model_dir = None
            if name == "story":
                from chip_child.models.story_model import story_model_dir
                model_dir = str(story_model_dir())
            else:
                model_dir = str(Path(tmp) / "compute")
                write_random_qwen3(Path(model_dir), COMPUTE, 0)
            rows, ok = bench_model(name, model_dir, tmp)
            all_rows += rows
            same &= ok
    print(f"{'model':8} {'method':10} {'workload':15} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} "
          f"{'ratio':>6} {'accept':>7} {'mean len':>8}")
    for r in all_rows:
        print(f"{r['model']:8} {r['method']:10} {r['workload']:15} {r['batch']:>5} {r['plain_tok_s']:>12} "
              f"{r['spec_tok_s']:>11} {r['ratio']:>6} {str(r['acceptance']):>7} {str(r['mean_accepted_length']):>8}"
              f"{'  (no drafts: the ratio is noise)' if r['noise_only'] else ''}")
    print("tokens identical to plain decoding:", same)
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["story", "compute"], choices=["story", "compute"])
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft_self"],
                        choices=["ngram", "draft_self", "eagle_random"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    ARGS = parser.parse_args()
    sys.exit(main())
