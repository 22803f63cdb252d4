"""Times the torch attention backend's decode paths on the CPU: per decode step, `plan` plus
`forward` (K/V write and attention) of every layer, for a batch that advances one position per
step, as steady decode does.

- gather: every layer copies every row's pages out of the cache, then attends (the portable
  paged attention the model used before the backends);
- mirror: the decode mirror: K/V read in place, only the new token appended;
- default: the backend's own choice per step (the mirror once a step would gather at least
  `mirror_min_bytes` over all layers).

And one prefill chunk without cached context, through SDPA's causal fast path on its own k/v
(the backend's choice) against the same chunk read back from its pages with a mask.

    python scripts/bench_attention_cpu.py [--threads 1] [--steps 30] [--repeats 3]

Variants alternate within each repeat; the figure is the median over repeats of each repeat's
median step. Compare ratios from one run: shared machines are noisy.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from chip_child.attention import AttentionMetadata, AttentionSpec
from chip_child.attention.torch_backend import TorchAttention

CONFIGS = {
    # name: layers, heads, kv heads, head dim, batch, context at the first timed step, page size
    "tiny (2L, 2/1 heads, hd 16)": (2, 2, 1, 16, 16, 128, 128),
    "58M-like (8L, 8/4 heads, hd 64)": (8, 8, 4, 64, 16, 256, 128),
    "Qwen3-0.6B attention (4 of 28L, 16/8 heads, hd 128)": (4, 16, 8, 128, 16, 1024, 128),
}


def decode_steps(backend: TorchAttention, layers: int, batch: int, context: int, page: int, steps: int,
                 heads: int, kv_heads: int, head_dim: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    spec = backend.spec
    table = torch.zeros(batch, spec.max_blocks, dtype=torch.int32)
    pages = torch.randperm(spec.num_pages - 1, generator=gen) + 1
    table[:, :] = pages[:batch * spec.max_blocks].view(batch, spec.max_blocks).int()
    # Fill the context once (a prefill through the cache), as a warm start.
    meta = AttentionMetadata.from_lengths([context] * batch, [context] * batch, table, page)
    kv = torch.randn(2, batch * context, kv_heads, head_dim, generator=gen)
    for layer in range(layers):
        backend.write_kv(layer, kv[0], kv[1], meta.slot_mapping)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    k, v = torch.randn(2, batch, kv_heads, head_dim, generator=gen)
    out = torch.empty_like(q)
    times = []
    for i in range(steps + 2):
        lens = [context + i + 1] * batch
        meta = AttentionMetadata.from_lengths([1] * batch, lens, table, page)
        start = time.perf_counter()
        step = backend.plan(meta)
        for layer in range(layers):
            backend.forward(layer, q, k, v, step, out=out)
        times.append(time.perf_counter() - start)
    return times[2:]  # the first step of the mirror re-gathers every row after the prefill


def prefill_chunk(backend: TorchAttention, heads: int, kv_heads: int, head_dim: int, length: int, page: int,
                  fast: bool) -> float:
    gen = torch.Generator().manual_seed(1)
    table = (torch.randperm(backend.spec.num_pages - 1, generator=gen)[:backend.spec.max_blocks] + 1).int()[None]
    meta = AttentionMetadata.from_lengths([length], [length], table, page)
    q = torch.randn(length, heads, head_dim, generator=gen)
    k, v = torch.randn(2, length, kv_heads, head_dim, generator=gen)
    backend.write_kv(0, k, v, meta.slot_mapping)
    step = backend.plan(meta)
    start = time.perf_counter()
    backend.attend(0, q, step, k=k if fast else None, v=v if fast else None)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps x {args.repeats} repeats")
    for name, (layers, heads, kvh, hd, batch, context, page) in CONFIGS.items():
        blocks = math.ceil((context + args.steps + 3) / page)
        spec = AttentionSpec(num_layers=layers, num_heads=heads, num_kv_heads=kvh, head_dim=hd,
                             num_pages=batch * blocks + 1, page_size=page, dtype=torch.float32, max_tokens=batch,
                             max_seqs=batch, max_blocks=blocks)
        backends = {"gather": TorchAttention(spec, "cpu", decode_mirror=False),
                    "mirror": TorchAttention(spec, "cpu", decode_mirror=True, mirror_budget_bytes=1 << 40,
                                             mirror_min_bytes=0),
                    "default": TorchAttention(spec, "cpu", mirror_budget_bytes=1 << 40)}
        for backend in backends.values():
            backend.allocate()
        medians = {k: [] for k in backends}
        for _ in range(args.repeats):
            for label, backend in backends.items():
                medians[label].append(statistics.median(
                    decode_steps(backend, layers, batch, context, page, args.steps, heads, kvh, hd)))
        g, m, d = (statistics.median(medians[k]) * 1e3 for k in ("gather", "mirror", "default"))
        print(f"{name}, batch {batch}, context {context}+: decode step gather {g:.3f} ms, mirror {m:.3f} ms "
              f"(mirror/gather {m / g:.2f}), default policy {d:.3f} ms ({d / g:.2f})")
    heads, kvh, hd, length, page = 16, 8, 128, 512, 128
    spec = AttentionSpec(num_layers=1, num_heads=heads, num_kv_heads=kvh, head_dim=hd, num_pages=9, page_size=page,
                         dtype=torch.float32, max_tokens=length, max_seqs=1, max_blocks=length // page)
    backend = TorchAttention(spec, "cpu", decode_mirror=False).allocate()
    fast, paged = [], []
    for _ in range(args.repeats * 3):
        fast.append(prefill_chunk(backend, heads, kvh, hd, length, page, True))
        paged.append(prefill_chunk(backend, heads, kvh, hd, length, page, False))
    f, p = statistics.median(fast) * 1e3, statistics.median(paged) * 1e3
    print(f"prefill chunk of {length} tokens (16/8 heads, hd 128), no cached context: SDPA causal fast path "
          f"{f:.2f} ms, from its pages with a mask {p:.2f} ms (fast/paged {f / p:.2f})")


if __name__ == "__main__":
    main()
