"""The prefix cache's host tier (kv_offloading_size): second-round TTFT with the tier against
recomputing, on the CPU.

Eight 512-token prompts, one at a time, over a device pool that holds about four of them; then
the same eight again. Without the tier the second round recomputes most prefixes; with it, the
prefixes come back by copy from host memory. Prints the second round's median TTFT for each,
their ratio, the cached tokens per request and the pages the tier stored and loaded, median of
--repeats runs with the two variants alternated; tokens are checked equal.

    PYTHONPATH=. python scripts/bench_kv_offload.py [--repeats 3] [--device cuda]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import write_random_qwen3  # noqa: E402

from l3worker import DistributedWorker, SamplingParams  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROMPT, PAGE = 512, 16
WORKER = dict(device="cpu", max_batch_size=2, max_seq_len=1024, page_size=PAGE, num_pages=4 * PROMPT // PAGE + 40)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def second_round(model: str, offload: float | None, prompts: list[list[int]]) -> tuple[list[float], list, dict]:
    with DistributedWorker(model, kv_offloading_size=offload, **WORKER) as w:
        for p in prompts:
            w.generate([p], GREEDY)
        outs = [w.generate([p], GREEDY)[0] for p in prompts]
        host = w.engine.scheduler.pages.host
        tier = {"stored": host.stored_pages, "loaded": host.loaded_pages} if host else {}
    return [o.metrics.ttft_s for o in outs], outs, tier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the attention is the triton backend)")
    args = ap.parse_args()
    WORKER["device"] = args.device
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-offload-"))
    try:
        write_random_qwen3(tmp / "m", MODEL, seed=0)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 32000, PROMPT).tolist() for _ in range(8)]
        ttft: dict[str, list[float]] = {"recompute": [], "host tier": []}
        for _ in range(args.repeats):
            base, base_outs, _ = second_round(str(tmp / "m"), None, prompts)
            tier, tier_outs, books = second_round(str(tmp / "m"), 0.25, prompts)
            assert [o.outputs[0].token_ids for o in base_outs] == [o.outputs[0].token_ids for o in tier_outs]
            ttft["recompute"].append(statistics.median(base))
            ttft["host tier"].append(statistics.median(tier))
        r, t = statistics.median(ttft["recompute"]), statistics.median(ttft["host tier"])
        print(f"second-round TTFT on {args.device}, median over 8 prompts of {PROMPT} tokens, "
              f"median of {args.repeats} runs:")
        print(f"  recompute {r * 1e3:.1f} ms; host tier {t * 1e3:.1f} ms ({t / r:.3f}x)")
        print(f"  cached tokens per request: recompute {[o.num_cached_tokens for o in base_outs]}, "
              f"host tier {[o.num_cached_tokens for o in tier_outs]}; tier pages {books}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
