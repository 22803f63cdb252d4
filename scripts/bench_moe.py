#!/usr/bin/env python
"""CPU decode step of a Qwen3-MoE model against the dense Qwen3 with the same active parameters.

Two random checkpoints differ only in their MLPs: the MoE has --experts experts of
--moe-inter each, --top-k of them active per token; the dense model's MLP is --top-k x
--moe-inter wide, so both spend the same multiply-adds per token on their MLPs (the MoE adds its
router, [hidden, experts]). For each row count a runtime of each times the median greedy decode
step with every row active (ChipRuntime.time_steps), the two alternating within each repeat;
printed: the medians over --repeats in ms and MoE / dense. The MoE's experts stay plain torch.mm
(only the dense projections are prepacked), so this also shows what grouping by expert costs.

    python scripts/bench_moe.py
    python scripts/bench_moe.py --rows 1,16 --experts 128 --top-k 8 --repeats 7
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere

import torch  # noqa: E402
from bench_models import write_random_qwen3  # noqa: E402  (scripts/, next to this file)

from chip_child.step.runtime import ChipRuntime, RuntimeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8", help="decode rows (comma-separated)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per repeat (median kept)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="at most this long on decode steps per repeat")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the runtime's)")
    args = ap.parse_args()
    base = dict(vocab_size=1000, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    configs = {"dense": ("Qwen3", {**base, "intermediate_size": args.top_k * args.moe_inter}),
               "moe": ("Qwen3Moe", {**base, "intermediate_size": args.moe_inter, "num_experts": args.experts,
                                    "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_inter,
                                    "norm_topk_prob": True})}
    print(f"torch {torch.__version__}, fp32, hidden {args.hidden}, {args.layers} layers; MoE: {args.experts} experts "
          f"x {args.moe_inter}, top-{args.top_k}; dense MLP {args.top_k * args.moe_inter}; median of {args.repeats}")
    print(f"{'rows':>4} | {'dense':>10} {'moe':>10} {'moe/dense':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, config) in configs.items():
            write_random_qwen3(Path(tmp) / name, config, seed=0, family=family)
        for rows in (int(r) for r in args.rows.split(",")):
            runtimes = {name: ChipRuntime(RuntimeConfig(str(Path(tmp) / name), device="cpu", dtype="float32",
                                                        max_batch_size=rows, max_seq_len=256, page_size=16,
                                                        num_threads=args.threads))
                        for name in configs}
            times: dict[str, list[float]] = {name: [] for name in configs}
            try:
                for _ in range(args.repeats):
                    for name, rt in runtimes.items():
                        times[name].append(rt.time_steps(rows * 16, args.steps, args.budget_s)[1])
            finally:
                for rt in runtimes.values():
                    rt.close()
            dense, moe = (statistics.median(times[n]) for n in ("dense", "moe"))
            print(f"{rows:>4} | {dense * 1e3:>7.3f} ms {moe * 1e3:>7.3f} ms {moe / dense:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
