"""FP8 KV cache against the model's dtype: quality, capacity and decode speed.

Quality, on a random Qwen3 and on the built-in trained story model: a greedy continuation made
with the ordinary cache is scored again (prompt_logprobs, teacher-forced) with each cache, and
the two are compared position by position: top-1 agreement and the largest and mean difference
of the log-probability of the token that came. Free-running greedy agreement: the share of
positions before the two caches' greedy outputs part. Capacity: KV pages for the same
`--gpu-memory-utilization` at bf16 and at fp8. Speed: decode ms per token at batch 8, median of
--repeats, the two caches alternated.

    PYTHONPATH=. python scripts/bench_kv_fp8.py [--repeats 3] [--device cuda]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import write_random_qwen3  # noqa: E402

from chip_child.models.story_model import story_model_dir  # noqa: E402
from l3worker import DistributedWorker, SamplingParams  # noqa: E402

RANDOM = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=4096,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
WORKER = dict(device="cpu", max_batch_size=8, max_seq_len=512, page_size=16)


def quality(model: str, prompt: list[int], n: int) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs, scored = {}, {}
    for kv in ("auto", "fp8"):
        with DistributedWorker(model, kv_cache_dtype=kv, **WORKER) as w:
            outs[kv] = w.generate([prompt], greedy)[0].outputs[0].token_ids
            seq = prompt + outs["auto"] if kv == "fp8" else prompt + outs[kv]
            score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
            scored[kv] = [lp for lp in w.generate([seq], score)[0].prompt_logprobs[len(prompt):]]
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(scored["auto"], scored["fp8"])]
    top1 = [a.top[0][0] == b.top[0][0] for a, b in zip(scored["auto"], scored["fp8"])]
    parted = next((i for i, (a, b) in enumerate(zip(outs["auto"], outs["fp8"])) if a != b), n)
    return {"top1_agreement": sum(top1) / len(top1), "max_logprob_diff": max(diffs),
            "mean_logprob_diff": statistics.mean(diffs), "greedy_same_until": parted, "tokens": n}


def decode_ms(model: str, kv: str, new: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    with DistributedWorker(model, kv_cache_dtype=kv, **WORKER) as w:
        w.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
        t0 = time.perf_counter()
        w.generate([[5 + i, 6, 7, 8] for i in range(8)], params)
        return (time.perf_counter() - t0) * 1e3 / new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the attention is the triton backend)")
    args = ap.parse_args()
    WORKER["device"] = args.device
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-fp8-"))
    try:
        run(tmp / "random", args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(random_dir: Path, repeats: int) -> None:
    write_random_qwen3(random_dir, RANDOM, seed=0)
    models = {"random 4-layer Qwen3": str(random_dir), "story model (trained)": str(story_model_dir())}
    print("quality (fp8 cache against the model's dtype, fp32 here), 200 tokens after a 64-token prompt:")
    for name, path in models.items():
        q = quality(path, list(range(3, 67)), 200)
        print(f"  {name}: top-1 {q['top1_agreement']:.3f}, |d logprob| max {q['max_logprob_diff']:.4f} mean "
              f"{q['mean_logprob_diff']:.5f}, greedy outputs equal for the first {q['greedy_same_until']} of "
              f"{q['tokens']} tokens")
    pages = {kv: DistributedWorker(str(random_dir), dtype="bfloat16", gpu_memory_utilization=0.05, kv_cache_dtype=kv,
                                   **WORKER).kv_sizing.num_pages for kv in ("auto", "fp8")}
    print(f"capacity at --gpu-memory-utilization 0.05, bf16 model: {pages['auto']} pages with a bf16 cache, "
          f"{pages['fp8']} with fp8 ({pages['fp8'] / pages['auto']:.2f}x)")
    times: dict[str, list[float]] = {"auto": [], "fp8": []}
    for _ in range(repeats):
        for kv in ("auto", "fp8"):
            times[kv].append(decode_ms(str(random_dir), kv, 64))
    auto, fp8 = (statistics.median(times[k]) for k in ("auto", "fp8"))
    print(f"decode, batch 8, random model, fp32 compute, {WORKER['device']}: {auto:.2f} ms/token with the fp32 "
          f"cache, {fp8:.2f} with fp8 "
          f"({fp8 / auto:.2f}x), median of {repeats}")


if __name__ == "__main__":
    main()
