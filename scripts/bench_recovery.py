"""Recovery figures: how long a chip-child's death costs a running request, and what it costs a load.

1. Death to first resumed token: one request streams; its child is SIGKILLed after a few tokens;
   the time from the kill to the next token (the engine notices, restarts the child: a fresh
   interpreter, weights mapped again, warm-up; then prefills prompt + tokens so far). Median of
   --repeats, on the built-in model and a random ~58M Qwen3 (scripts/bench_models.py).
2. A load of --requests requests (greedy and seeded), undisturbed, then again with the child
   killed once when half of them finished: completed requests, identical outputs, throughput ratio.

    PYTHONPATH=. python scripts/bench_recovery.py [--repeats 3] [--requests 200]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import write_random_qwen3  # noqa: E402
from l3worker import DistributedWorker, SamplingParams  # noqa: E402

MODEL_58M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                 max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)
WORKER = dict(device="cpu", max_batch_size=16, max_seq_len=512, page_size=16)


def restarts(w: DistributedWorker) -> int:
    return int(w.engine.metrics.value("l3worker:engine_restarts_total"))


def death_to_resumed_token(model_dir: str | None, repeats: int) -> dict:
    """Seconds from SIGKILL to the next token of the stream that was running."""
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    gaps = []
    with DistributedWorker(model_dir, **WORKER, max_restarts=repeats) as w:
        for r in range(repeats):
            killed_at = None
            for i, out in enumerate(w.stream([list(range(1, 65))], params)):
                if i == 8:
                    os.kill(w.child_pids[0], signal.SIGKILL)
                    killed_at = time.perf_counter()
                elif killed_at is not None and restarts(w) > r:  # not a token the dead child had made
                    gaps.append(time.perf_counter() - killed_at)
                    break
            for request_id in list(w.engine.requests):
                w.engine.abort(request_id)
            w.generate([[1]], SamplingParams(temperature=0.0, max_new_tokens=1))  # lets the aborts through
        setup_s = w.stats()["child_setup_s"]
    return {"death_to_token_s": round(statistics.median(gaps), 3), "all_s": [round(g, 3) for g in gaps],
            "child_setup_s": round(setup_s, 3)}


def load(requests: int, kill: bool) -> tuple[list[list[int]], float, int]:
    """Token ids of every request, wall seconds, restarts."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(8 + i % 24)] for i in range(requests)]
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(requests)]
    with DistributedWorker(None, **WORKER) as w:
        finals = {}
        t0 = time.perf_counter()
        for out in w.stream(prompts, params):
            if out.finished:
                finals[out.request_id] = out.token_ids
                if kill and len(finals) == requests // 2:
                    os.kill(w.child_pids[0], signal.SIGKILL)
        wall = time.perf_counter() - t0
        return [finals[k] for k in sorted(finals, key=int)], wall, restarts(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-58m"
        n = write_random_qwen3(path, MODEL_58M)
        for name, model_dir in (("builtin", None), (f"random-{n / 1e6:.0f}M", str(path))):
            results[name] = death_to_resumed_token(model_dir, args.repeats)
            print(name, json.dumps(results[name]), flush=True)
    calm, calm_s, _ = load(args.requests, kill=False)
    hit, hit_s, restarted = load(args.requests, kill=True)
    results["load"] = {"requests": args.requests, "completed": len(hit), "restarts": restarted,
                       "identical_outputs": hit == calm, "undisturbed_s": round(calm_s, 2),
                       "with_kill_s": round(hit_s, 2), "throughput_ratio": round(calm_s / hit_s, 3)}
    print("load", json.dumps(results["load"]), flush=True)


if __name__ == "__main__":
    main()
