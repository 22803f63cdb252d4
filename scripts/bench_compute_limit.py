#!/usr/bin/env python
"""The compute limit of an offline run on this CPU, measured now, and offline throughput against it.

The limit counts only the projections, every layer's and the lm_head's, on the fastest bf16
kernel here (l3worker's AMX kernel where the cpu has AMX, else its AVX-512 one), with cold weights
(one copy per layer, as in the model). For `--num-prompts` prompts of `--input-len` tokens, each
generating `--output-len`, `--max-num-seqs` at a time:
  - decode: (output-len - 1) steps per wave of max-num-seqs rows, each step one pass of all the
    projections at that many rows (at this size a pass is bound by reading the weights);
  - prompts: every prompt token through the layers' projections, at the rate of `--chunk`-row
    passes (bound by the GEMM rate), plus one lm_head row per prompt.
Attention, norms, sampling and the host's work are left out, so no engine reaches the limit.

    python scripts/bench_compute_limit.py CKPT                  # the limit alone
    python scripts/bench_compute_limit.py CKPT --offline 3      # and `l3worker bench throughput`, alternated

With --offline N, the limit and `l3worker bench throughput` (same prompts, lengths and batch, bf16)
alternate N times; each round prints both and their ratio, then the medians. Dense Qwen3-style
checkpoints only (a config.json with hidden_size, intermediate_size, the head counts and sizes).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # chip_child, run from anywhere
from chip_child.cpu_kernels import bf16_amx, bf16_linear  # noqa: E402


def projection_shapes(cfg: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of one layer's fused projections (qkv, o, gate_up, down) and of the lm_head."""
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise SystemExit("bench_compute_limit: dense checkpoints only (this one has experts)")
    inter = cfg["intermediate_size"]
    return [((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * inter, h), (h, inter)], (cfg["vocab_size"], h)


class Projections:
    """Random bf16 weights of the model's shapes, packed for the fastest kernel here."""

    def __init__(self, cfg: dict, threads: int):
        torch.set_num_threads(threads)
        layer, self.head = projection_shapes(cfg)
        self.layer = layer
        best = bf16_linear.best_kernel()  # AVX-512, else AVX2
        if best is None:
            raise SystemExit("bench_compute_limit: neither bf16 kernel runs here (the reasons are printed above)")
        kernel, lib = best
        fits = kernel == "avx512_bf16" and all(bf16_amx.fits(k) for _, k in layer + [self.head])
        amx = bf16_amx.KERNEL.library() if fits else None
        self.name = "amx" if amx is not None else kernel.removesuffix("_bf16")
        self.run_one = (lambda x, w, n: bf16_amx.linear(amx, x, w, n)) if amx is not None else (
            lambda x, w, n: bf16_linear.linear(lib, x, w, n))
        self.layers = [[bf16_linear.pack(lib, torch.randn(n, k).bfloat16()) for n, k in layer]
                       for _ in range(cfg["num_hidden_layers"])]
        self.lm_head = bf16_linear.pack(lib, torch.randn(*self.head).bfloat16())
        self.layer_flops = 2 * sum(n * k for n, k in layer) * len(self.layers)  # per row
        self.bytes = 2 * (sum(n * k for n, k in layer) * len(self.layers) + self.head[0] * self.head[1])

    def time_pass(self, rows: int, layers: bool, lm_head: bool, repeats: int) -> float:
        """Median seconds of one pass at `rows` over every layer's projections and/or the lm_head."""
        xs = [torch.randn(rows, k).bfloat16() for _, k in self.layer]
        xh = torch.randn(rows, self.head[1]).bfloat16()

        def once() -> float:
            t0 = time.perf_counter()
            for ws in self.layers if layers else ():
                for x, w, (n, _) in zip(xs, ws, self.layer):
                    self.run_one(x, w, n)
            if lm_head:
                self.run_one(xh, self.lm_head, self.head[0])
            return time.perf_counter() - t0

        once()
        return statistics.median(once() for _ in range(repeats))


def limit(p: Projections, a: argparse.Namespace) -> dict:
    """Output tokens per second that the projections alone allow for the workload."""
    decode_s = p.time_pass(a.max_num_seqs, True, True, a.repeats)
    chunk_s = p.time_pass(a.chunk, True, False, max(2, a.repeats // 3))
    head_row_s = p.time_pass(1, False, True, a.repeats)  # a prompt's last token through the lm_head
    waves = math.ceil(a.num_prompts / a.max_num_seqs)
    prompt_tokens = a.num_prompts * a.input_len
    total_s = (waves * (a.output_len - 1) * decode_s + prompt_tokens / a.chunk * chunk_s
               + a.num_prompts * head_row_s)
    return {"kernel": p.name, "decode_step_ms": decode_s * 1e3, "weights_gb_s": p.bytes / decode_s / 1e9,
            "prompt_gflops": p.layer_flops * a.chunk / chunk_s / 1e9, "seconds": total_s,
            "tok_s": a.num_prompts * a.output_len / total_s}


def offline(a: argparse.Namespace) -> float:
    """`l3worker bench throughput` on the workload: its output tokens per second."""
    cmd = [sys.executable, "-m", "l3worker", "bench", "throughput", "--model", a.model, "--dtype", "bfloat16",
           "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.input_len + a.output_len + 256),
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"([0-9.]+) output tokens/s", out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"bench_compute_limit: {' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory (its config.json gives the shapes)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="rows of the prompt passes the GEMM rate is taken at")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--offline", type=int, default=0, metavar="N", help="alternate with l3worker's offline run N times")
    a = ap.parse_args(argv)
    for field in ("num_prompts", "input_len", "output_len", "max_num_seqs", "chunk", "threads", "repeats"):
        if getattr(a, field) < 1:
            ap.error(f"--{field.replace('_', '-')} must be at least 1, got {getattr(a, field)}")
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    p = Projections(cfg, a.threads)
    print(f"{a.model}: {p.bytes / 1e6:.0f} MB of bf16 projections, {a.threads} threads, the {p.name} kernel; "
          f"{a.num_prompts} prompts of {a.input_len} in, {a.output_len} out, {a.max_num_seqs} at a time")
    ratios, limits, offlines = [], [], []
    for i in range(max(1, a.offline)):
        got = limit(p, a)
        limits.append(got["tok_s"])
        line = (f"round {i + 1}: limit {got['tok_s']:.0f} output tok/s (decode pass {got['decode_step_ms']:.2f} ms, "
                f"{got['weights_gb_s']:.1f} GB/s; prompts {got['prompt_gflops']:.0f} GFLOPS)")
        if a.offline:
            offlines.append(offline(a))
            ratios.append(offlines[-1] / limits[-1])
            line += f"; offline {offlines[-1]:.0f} tok/s, {ratios[-1]:.2f} of the limit"
        print(line, flush=True)
    if a.offline > 1:
        print(f"median: limit {statistics.median(limits):.0f} tok/s, offline {statistics.median(offlines):.0f} "
              f"tok/s, offline / limit {statistics.median(ratios):.2f} (per round: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
