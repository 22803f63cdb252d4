#!/usr/bin/env python
"""Scheduler figures on live-traffic shapes, each printed with its comparison from the same run:

  stall    8 rows decode while a 3,000-token prompt arrives: tokens those rows produce during its
           prefill and their inter-token latency there (p50, p99), for each --budgets value
           (max_num_batched_tokens; one at least the prompt's length prefills it in one step)
  prefix   two requests sharing a 1,536-token prefix: the second's TTFT over the first's, with
           the prefix cache on and off
  pages    a pool that fits only half the rows at their worst case: how many rows ran at once,
           preemptions, and whether every output equals a large pool's
  host     the parent's scheduling time per decode step (next_command and on_tokens, no model) with
           1 and 16 rows decoding, at max_num_seqs 16 and 256: what a step costs should follow the
           rows that run, not the rows that could

Model: a random Qwen3 checkpoint of a few million parameters (4 layers, hidden 256), fp32 on
the cpu. Timings are medians over --repeats; compare ratios within one run.

    python scripts/bench_scheduler.py [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_models import write_random_qwen3  # scripts/, next to this file

from l3worker import DistributedWorker, SamplingParams
from l3worker.engine.scheduler import Scheduler
from l3worker.engine.sequence import Sequence

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=8192,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


def write_checkpoint(path: Path) -> Path:
    write_random_qwen3(path, MODEL)
    return path


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, MODEL["vocab_size"], n).tolist()


def stall(model_dir: Path, budget: int, prompt_len: int = 3000, rows: int = 8) -> dict:
    """Tokens and ITL of `rows` decoding rows while one long prompt is prefilled."""
    rng = np.random.default_rng(1)
    with DistributedWorker(model_dir, max_batch_size=rows + 1, max_seq_len=4096, page_size=128,
                           max_num_batched_tokens=budget) as w:
        engine = w.engine
        decoding = [engine.add_request(ids(rng, 32), SamplingParams(temperature=0.0, max_new_tokens=3000, ignore_eos=True),
                                       stream=True) for _ in range(rows)]
        while min(len(s.seqs[0].tokens) for s in decoding) < 4:
            engine.step()
        long = engine.add_request(ids(rng, prompt_len), SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        last = {s.request_id: t0 for s in decoding}
        gaps: list[float] = []
        produced = 0
        while not long.finished:
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id in last and out.outputs and out.outputs[0].delta_token_ids:
                    produced += len(out.outputs[0].delta_token_ids)
                    gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
        prefill_s = time.perf_counter() - t0
        for s in decoding:
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()
    return {"budget": budget, "prefill_s": prefill_s, "tokens_during_prefill": produced,
            "itl_p50_s": float(np.percentile(gaps, 50)) if gaps else None,
            "itl_p99_s": float(np.percentile(gaps, 99)) if gaps else None}


def prefix(model_dir: Path, caching: bool, shared: int = 1536) -> dict:
    rng = np.random.default_rng(2)
    head = ids(rng, shared)
    with DistributedWorker(model_dir, max_batch_size=2, max_seq_len=2048, page_size=128,
                           enable_prefix_caching=caching) as w:
        w.generate([ids(rng, 8)], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up, unrelated prompt
        first = w.generate([head + ids(rng, 16)], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
        second = w.generate([head + ids(rng, 16)], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
    return {"caching": caching, "first_ttft_s": first.metrics.ttft_s, "second_ttft_s": second.metrics.ttft_s,
            "ratio": second.metrics.ttft_s / first.metrics.ttft_s, "second_cached_tokens": second.num_cached_tokens}


def pages(model_dir: Path, rows: int = 8, prompt_len: int = 64, new: int = 192, page: int = 16) -> dict:
    rng = np.random.default_rng(3)
    prompts = [ids(rng, prompt_len) for _ in range(rows)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    worst = -(-(prompt_len + new - 1) // page)
    with DistributedWorker(model_dir, max_batch_size=rows, max_seq_len=512, page_size=page) as w:
        want = [o.token_ids for o in w.generate(prompts, params)]
    with DistributedWorker(model_dir, max_batch_size=rows, max_seq_len=512, page_size=page,
                           num_pages=rows * worst // 2) as w:
        engine = w.engine
        states = [engine.add_request(p, params) for p in prompts]
        most = 0
        finals = {}
        while len(finals) < rows:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            most = max(most, len(engine.scheduler.running))
        got = [finals[s.request_id].token_ids for s in states]
        preemptions = engine.scheduler.num_preemptions
    return {"rows": rows, "worst_case_pages_per_row": worst, "num_pages": rows * worst // 2,
            "rows_at_once_reserving_worst_case": rows // 2, "rows_at_once": most, "preemptions": preemptions,
            "identical_to_large_pool": got == want}


def host(max_num_seqs: int, running: int, steps: int = 4000) -> float:
    """Seconds of scheduling per decode step, `running` rows decoding (prefilled before timing)."""
    sched = Scheduler(max_batch_size=max_num_seqs, page_size=16, max_blocks_per_row=512, num_pages=running * 512 + 1,
                      max_num_batched_tokens=8192, enable_prefix_caching=True, full_state=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=2 * steps, ignore_eos=True)
    sched.add([Sequence(i, 0, np.arange(1, 129, dtype=np.int32), params, 0, frozenset(), request_id=str(i))
               for i in range(running)])
    ids = np.ones(max_num_seqs, np.int32)

    def run(n: int) -> None:
        for _ in range(n):
            s = sched.next_command()
            sched.on_tokens(s.producers, ids, 0.0)

    run(8)  # the prefill and the first decode steps
    t0 = time.perf_counter()
    run(steps)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="256,512,4096",
                    help="max_num_batched_tokens values for the stall figure (default: %(default)s)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as tmp:
        model_dir = write_checkpoint(Path(tmp) / "model")
        result: dict = {"model": MODEL}
        budgets = [int(b) for b in args.budgets.split(",")]
        runs: dict[int, list[dict]] = {b: [] for b in budgets}
        for _ in range(args.repeats):  # alternating, so load on the machine spreads over every budget
            for b in budgets:
                runs[b].append(stall(model_dir, b))
        result["stall"] = {str(b): {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
                           for b, rs in runs.items()}
        for b, r in result["stall"].items():
            p99 = f"{r['itl_p99_s'] * 1e3:.1f} ms" if "itl_p99_s" in r else "-"
            print(f"stall  max_num_batched_tokens={b:>5}: 8 rows produced {r['tokens_during_prefill']:.0f} tokens "
                  f"during the 3,000-token prefill ({r['prefill_s'] * 1e3:.0f} ms); their ITL p99 there {p99}")
        pre = {c: [prefix(model_dir, c) for _ in range(args.repeats)] for c in (True, False)}
        result["prefix"] = {str(c): {k: statistics.median(r[k] for r in rs) for k in ("first_ttft_s", "second_ttft_s",
                                                                                   "ratio", "second_cached_tokens")}
                            for c, rs in pre.items()}
        for c, r in result["prefix"].items():
            print(f"prefix caching={c:<5}: TTFT first {r['first_ttft_s'] * 1e3:.1f} ms, second "
                  f"{r['second_ttft_s'] * 1e3:.1f} ms, ratio {r['ratio']:.3f} ({r['second_cached_tokens']:.0f} tokens "
                  f"cached)")
        result["pages"] = pages(model_dir)
        p = result["pages"]
        print(f"pages  {p['num_pages']} pages for {p['rows']} rows needing {p['worst_case_pages_per_row']} each at worst: "
              f"{p['rows_at_once']} rows ran at once (reserving the worst case: {p['rows_at_once_reserving_worst_case']}), "
              f"{p['preemptions']} preemptions, outputs identical to a large pool: {p['identical_to_large_pool']}")
    result["host"] = {f"{n}/{b}": statistics.median(host(b, n) for _ in range(args.repeats))
                      for n in (1, 16) for b in (16, 256)}
    for key, t in result["host"].items():
        n, b = key.split("/")
        print(f"host   {n:>2} rows decoding, max_num_seqs {b:>3}: {t * 1e6:.1f} us of scheduling per step")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["pages"]["identical_to_large_pool"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
