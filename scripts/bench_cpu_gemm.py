#!/usr/bin/env python
"""The CPU decode step's projections alone, cold: a loop over every layer's own weights (too many
to stay in cache, as in a model), bf16, on l3worker's AVX-512 BF16 kernel (chip_child/cpu_kernels/
bf16_linear.cpp) or, on a cpu without it, its AVX2 one (bf16_linear_avx2.cpp), on its AMX kernel
where the cpu has AMX (bf16_amx.cpp, then the runtime's default for these shapes), prepacked for
oneDNN (where oneDNN has bf16 on this cpu), plain F.linear, and float32 prepacked for oneDNN (what
a cpu without a bf16 kernel would run), at a few row counts. Printed per variant: ms for all layers, the weight
read rate and the GEMM rate. This is the floor a decode step's projections could reach with
today's kernels; compare it with the step time `scripts/step_breakdown.py` reports.

    python scripts/bench_cpu_gemm.py                       # the 128M peers shape, 2 threads
    python scripts/bench_cpu_gemm.py --hidden 1024 --intermediate 3072 --layers 28 --threads 1
    python scripts/bench_cpu_gemm.py --against HEAD~1 --rows 1,8,16,65   # our kernel against a past version

--against REV builds the kernel in use (bf16_linear.cpp, or bf16_linear_avx2.cpp on a cpu without
AVX-512) as it was at git revision REV, with that revision's headers, beside the working tree's
and times the two alternately on the same packed weights (their packed layouts must agree),
printing each one's median and the ratio; their outputs must be the same bits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere
from chip_child.cpu_kernels import bf16_amx, bf16_linear  # noqa: E402
from chip_child.cpu_kernels.build import first_usable  # noqa: E402
from bench_common import past_cpu_kernel  # noqa: E402


def against(lib, past, rev: str, shapes, ours, m: int, repeats: int, weight_bytes: int) -> None:
    """The current kernel and the one at `rev`, alternated on the same packed weights."""
    xs = [torch.randn(m, k).bfloat16() for _, k in shapes]
    for n, k in shapes:
        if past.l3_bf16_packed_elements(n, k) != lib.l3_bf16_packed_elements(n, k):
            sys.exit(f"--against {rev}: its packed layout differs from the working tree's")
    outs = {}

    def run(kernel) -> float:
        t0 = time.perf_counter()
        for ws in ours:
            for x, w, (n, _) in zip(xs, ws, shapes):
                outs[id(kernel)] = bf16_linear.linear(kernel, x, w, n)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"l3worker": [], f"@{rev}": []}
    for _ in range(repeats + 1):  # the first round warms both up
        for name, kernel in (("l3worker", lib), (f"@{rev}", past)):
            times[name].append(run(kernel))
    if not torch.equal(outs[id(lib)], outs[id(past)]):
        print(f"rows {m:>3}: the two kernels' outputs differ")
    base = statistics.median(times["l3worker"][1:])
    for name, t in times.items():
        dt = statistics.median(t[1:])
        print(f"rows {m:>3} {name:<10} {dt * 1e3:7.2f} ms  {weight_bytes / dt / 1e9:5.1f} GB/s  "
              f"{m * weight_bytes / dt / 1e9:5.0f} GFLOPS  x{dt / base:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--against", default=None, metavar="REV", help="our kernel at this git revision, alternated")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    h, hd = a.hidden, a.head_dim
    shapes = [((a.heads + 2 * a.kv_heads) * hd, h), (h, a.heads * hd), (2 * a.intermediate, h), (h, a.intermediate)]
    plain = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(a.layers)]
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in plain] if onednn_bf16 else None
    packed_f32 = [[torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in ws] for ws in plain]
    kernel_name, lib = bf16_linear.best_kernel() or ("none", None)
    ours = [[bf16_linear.pack(lib, w) for w in ws] for ws in plain] if lib is not None else None
    amx_fits = kernel_name == "avx512_bf16" and all(bf16_amx.fits(k) for _, k in shapes)
    amx = bf16_amx.KERNEL.library() if amx_fits else None
    weight_bytes = sum(n * k * 2 for n, k in shapes) * a.layers
    print(f"{a.layers} layers, {weight_bytes / 1e6:.0f} MB of bf16 projections, {a.threads} threads, "
          f"our kernel: {kernel_name} (GB/s: the bf16 bytes, twice that read in float32)")
    if a.against:
        if ours is None:
            sys.exit("--against: our kernel does not run here")
        with tempfile.TemporaryDirectory() as tmp:
            past = past_cpu_kernel(first_usable(bf16_linear.KERNEL, bf16_linear.AVX2_KERNEL), a.against, tmp)
            for m in (int(r) for r in a.rows.split(",")):
                against(lib, past, a.against, shapes, ours, m, a.repeats, weight_bytes)
        return
    for m in (int(r) for r in a.rows.split(",")):
        xs = [torch.randn(m, k).bfloat16() for _, k in shapes]

        def run_packed() -> None:
            for ws in packed:
                for x, w in zip(xs, ws):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        xs_f32 = [x.float() for x in xs]

        def run_packed_f32() -> None:
            for ws in packed_f32:
                for x, w in zip(xs_f32, ws):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def run_plain() -> None:
            for ws in plain:
                for x, w in zip(xs, ws):
                    torch.nn.functional.linear(x, w)

        def run_ours() -> None:
            for ws in ours:
                for x, w, (n, _) in zip(xs, ws, shapes):
                    bf16_linear.linear(lib, x, w, n)

        def run_amx() -> None:
            for ws in ours:
                for x, w, (n, _) in zip(xs, ws, shapes):
                    bf16_amx.linear(amx, x, w, n)

        variants = [("l3worker", run_ours)] if ours is not None else []
        if ours is not None and amx is not None:
            variants.append(("amx", run_amx))
        if packed is not None:
            variants.append(("prepacked", run_packed))
        for name, fn in (*variants, ("plain", run_plain), ("f32-packed", run_packed_f32)):
            fn()
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                fn()
            dt = (time.perf_counter() - t0) / a.repeats
            print(f"rows {m:>3} {name:<10} {dt * 1e3:7.2f} ms  {weight_bytes / dt / 1e9:5.1f} GB/s  "
                  f"{m * weight_bytes / dt / 1e9:5.0f} GFLOPS")


if __name__ == "__main__":
    main()
