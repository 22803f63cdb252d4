#!/usr/bin/env python
"""The CPU decode step with the packed weights on huge pages (as the runtime loads them, see
chip_child/cpu_kernels/huge_pages.py) and on 4 KiB pages, in one process.

For each row count, one bf16 runtime loads a random Qwen3 (by default the 128M shape of the peers
side by side: hidden 768, 12 layers, vocabulary 32,000, tied embeddings) or --model, and gets a
second copy of every packed matrix on small pages (MADV_NOHUGEPAGE); the two copies take turns
under the same runtime, alternated each repeat, and each turn times the median greedy decode step
with every row active (ChipRuntime.time_steps). Printed per row count: each copy's median step
in ms and the median of the per-repeat ratios huge / small. Needs l3worker's bf16 linear kernels.

    python scripts/bench_cpu_huge_pages.py                        # rows 1 and 16, 7 repeats
    python scripts/bench_cpu_huge_pages.py --model /path/to/qwen3 --rows 1 --repeats 9
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere

import torch  # noqa: E402
from bench_cpu import BASE_MODEL  # noqa: E402  (scripts/, next to this file)
from bench_models import write_random_qwen3  # noqa: E402

from chip_child.cpu_kernels import huge_pages  # noqa: E402
from chip_child.step.runtime import ChipRuntime, RuntimeConfig  # noqa: E402
from chip_child.step.sleep import weight_leaves  # noqa: E402

PEERS_128M = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)


def small_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the flat tensor `t` in a mapping that refuses huge pages."""
    nbytes = t.numel() * t.element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    copy = torch.frombuffer(region, dtype=torch.uint8).view(t.dtype)
    copy.copy_(t)
    return copy


def anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def bench(model_dir: str, rows: int, args) -> dict[str, list[float]]:
    rt = ChipRuntime(RuntimeConfig(model_dir, device="cpu", dtype="bfloat16", max_batch_size=rows,
                                   max_seq_len=args.prompt_len + args.steps + 8, page_size=16,
                                   max_prefill_tokens=rows * args.prompt_len, num_threads=args.threads))
    try:
        if rt.cpu_linear not in ("amx_bf16", "avx512_bf16", "avx2_bf16"):
            sys.exit(f"the packed weights are not l3worker's kernel's here (cpu_linear={rt.cpu_linear})")
        packed = weight_leaves(rt.weights)[1]
        copies = {"huge": {id(p): p.weight for p in packed},
                  "small": {id(p): small_page_copy(p.weight) for p in packed}}
        print(f"rows {rows}: {len(packed)} packed matrices, {sum(p.weight.nbytes for p in packed) / 1e6:.0f} MB; "
              f"AnonHugePages {anon_huge_kib() / 1024:.0f} MiB; {huge_pages.STATS}")
        times: dict[str, list[float]] = {name: [] for name in copies}
        for _ in range(args.repeats):
            for name, weights in copies.items():
                for p in packed:
                    p.weight = weights[id(p)]
                if rt.decode_layers is not None:  # moved behind the runtime's back: its one-call layers look again
                    rt.decode_layers.weights_moved()
                times[name].append(rt.time_steps(rows * args.prompt_len, args.steps, args.budget_s)[1])
        for p in packed:
            p.weight = copies["huge"][id(p)]
        return times
    finally:
        rt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Qwen3 checkpoint directory (default: a random 128M one)")
    p.add_argument("--rows", default="1,16", help="comma-separated decode rows")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per turn (median taken)")
    p.add_argument("--budget-s", type=float, default=2.0, help="at most this long per turn")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    if not huge_pages.STATS.system_allows:
        sys.exit(f"transparent huge pages are {huge_pages.STATS.setting} here: nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            n = write_random_qwen3(Path(tmp), {**BASE_MODEL, **PEERS_128M})
            print(f"a random Qwen3 of {n / 1e6:.0f}M parameters")
        for rows in (int(r) for r in args.rows.split(",")):
            t = bench(model_dir, rows, args)
            ratios = [h / s for h, s in zip(t["huge"], t["small"])]
            print(f"rows {rows:>3}: decode step small pages {statistics.median(t['small']) * 1e3:.2f} ms, "
                  f"huge pages {statistics.median(t['huge']) * 1e3:.2f} ms, huge / small {statistics.median(ratios):.3f} "
                  f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
