#!/usr/bin/env python
"""Decode on a GPU against the memory roofline: random bf16 checkpoints of Qwen3-0.6B's and
Qwen3-8B's shapes, at several batch sizes.

Per model and batch, the decode step (one token per row, after a prefill of every prompt in one
step; the median over a run's steps in process, the decode's wall time over its steps behind a
chip-child) of:

  floor         ChipRuntime.execute in a loop in this process, decode graphs on
  floor_eager   the same runtime with its graphs set aside (every kernel launched from Python)
  floor_unfused a runtime with fused_kernels=False (the torch ops between the matmuls), graphs on
  l3            DistributedWorker (chip-child, pipeline depth 2), graphs on, overlapped steps (the cuda defaults)
  l3_in_order   the same with overlap_steps=False: the child completes each step before launching the next
  l3_eager      DistributedWorker with decode_graphs=False
  hf_static     transformers generate with cache_implementation="static", greedy, eager

and the roofline: the bytes a step must read (every weight once, the rows' K/V at the mean
context) and write (the new K/V) over the HBM bandwidth measured here by a device-to-device copy.
Token ids of every l3 variant are checked against the floor's with graphs on (exit status 1 if
they differ); eager and transformers' tokens are reported, not checked (bf16 rounding differs).

    python scripts/bench_gpu.py                       # 0.6b and 8b, batch 1, 16, 64
    python scripts/bench_gpu.py --models 0.6b --batches 1,16 --repeats 1
    python scripts/bench_gpu.py --device cpu --models tiny --batches 2 --prompt-len 8 --new-tokens 4   # smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from bench_common import L3 as L3Base  # scripts/, next to this file
from bench_common import Floor as FloorBase
from bench_common import digest, hf_generate, random_prompts

from chip_child.config import RuntimeConfig
from chip_child.step.runtime import ChipRuntime


@dataclass(frozen=True)
class Shape:
    """Qwen3Config fields of a model shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                           p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                           p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                           p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def kv_bytes_per_token(self, elem: int) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * elem

    def step_bytes(self, batch: int, context: float, elem: int) -> float:
        """Bytes a decode step must move: every weight read once (of the embedding table only
        the batch's rows, unless it is also the lm_head), the rows' K/V read at `context`
        positions each, and one new K/V position per row written."""
        total = 0
        for name, shape in self.weight_shapes().items():
            n = int(np.prod(shape))
            if name == "model.embed_tokens.weight" and not self.tie_word_embeddings:
                n = batch * self.hidden_size
            total += n
        return total * elem + batch * (context + 1) * self.kv_bytes_per_token(elem)


SHAPES = {
    "0.6b": Shape(151936, 1024, 3072, 28, 16, 8, 128, True),
    "8b": Shape(151936, 4096, 12288, 36, 32, 8, 128, False),
    "tiny": Shape(512, 64, 128, 2, 4, 2, 32, True),  # the cpu smoke run
}


def write_checkpoint(path: Path, shape: Shape, device: str, seed: int = 0) -> None:
    """A random bf16 Qwen3ForCausalLM checkpoint: projections ~ N(0, 0.02), norms 1. Drawn on
    the device (an 8B model's 8 billion normals take minutes on a cpu)."""
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, dims in shape.weight_shapes().items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(asdict(shape), architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
                  rope_theta=1000000.0, attention_bias=False, max_position_embeddings=40960, dtype="bfloat16",
                  hidden_act="silu", eos_token_id=None, bos_token_id=None, pad_token_id=None)
    (path / "config.json").write_text(json.dumps(config, indent=1))


def hbm_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[3:])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- variants: each returns (decode step seconds, tokens [batch, new_tokens]) ----------------------------
class Floor(FloorBase):
    def __init__(self, model_dir: str, args, max_batch: int, fused: bool | None = None,
                 quantization: str | None = None):
        self.args = args
        super().__init__(ChipRuntime(RuntimeConfig(model_dir, device=args.device, dtype="bfloat16",
                                                   quantization=quantization,
                                                   max_batch_size=max_batch,
                                                   max_seq_len=args.prompt_len + args.new_tokens,
                                                   page_size=args.page_size,
                                                   max_prefill_tokens=max_batch * args.prompt_len,
                                                   fused_kernels=fused)),
                         max_batch, args.page_size)
        self.graphs = self.rt.graphs

    def run(self, prompts: list[np.ndarray], graphs: bool) -> tuple[list[float], np.ndarray]:
        self.rt.graphs = self.graphs if graphs else None  # eager: every step launches its kernels from Python
        cmds, staging = self._commands(prompts, self.args.new_tokens)
        tokens = np.zeros((len(prompts), len(cmds)), np.int32)
        step_s = []
        for j, cmd in enumerate(cmds):
            t0 = time.perf_counter()
            self.rt.execute(cmd, staging, self.out)  # returns after the sampled ids reached the host
            if j:
                step_s.append(time.perf_counter() - t0)
            tokens[:, j] = self.out.numpy()[:len(prompts)]
        self.rt.graphs = self.graphs
        return step_s, tokens

    def kernels_per_step(self, prompts: list[np.ndarray]) -> int:
        """Kernels one eager decode step launches (a graph replays the same ones), counted by
        torch.profiler; copies and fills are not counted."""
        from torch.profiler import ProfilerActivity, profile

        self.rt.graphs = None
        cmds, staging = self._commands(prompts, 3)
        for cmd in cmds[:-1]:
            self.rt.execute(cmd, staging, self.out)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.rt.execute(cmds[-1], staging, self.out)
        self.rt.graphs = self.graphs
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.lower().startswith(("memcpy", "memset")))

    def close(self) -> None:
        self.rt.close()
        del self.rt, self.graphs


class L3(L3Base):
    def __init__(self, model_dir: str, args, max_batch: int, graphs: bool, overlap: bool | None = None):
        # The whole prefill in one step, as the floor sends it: the variants differ in decode alone.
        super().__init__(model_dir, device=args.device, dtype="bfloat16", max_batch_size=max_batch,
                         max_seq_len=args.prompt_len + args.new_tokens, page_size=args.page_size,
                         max_num_batched_tokens=max_batch * args.prompt_len,
                         decode_graphs=graphs and args.device != "cpu",  # cpu: the smoke run
                         overlap_steps=overlap, enable_prefix_caching=False)
        self.args = args

    def run(self, prompts: list[np.ndarray]) -> tuple[list[float], np.ndarray]:
        """The decode's wall time over its steps, not the median step period: with overlapped
        steps the parent can receive two steps' tokens at once, and eager, the periods alternated
        between 0.2 and 17 ms on an H200 (median 0.27 ms, below the roofline; the mean, 8.3 ms,
        is the step)."""
        tokens = self.generate(prompts, self.args.new_tokens)
        return [float(np.mean([r["parent_wall_s"] for r in self.decode_records()]))], tokens


class HFStatic:
    """transformers generate with a static cache, greedy; a logits processor stamps each step."""

    def __init__(self, model_dir: str, args):
        from transformers import Qwen3ForCausalLM

        self.args = args
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()

    def run(self, prompts: list[np.ndarray]) -> tuple[list[float], np.ndarray]:
        return hf_generate(self.model, prompts, self.args.new_tokens, "static", timed=True, device=self.args.device)

    def close(self) -> None:
        del self.model


def free_device(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bench_model(name: str, args) -> dict:
    shape = SHAPES[name]
    batches = args.batches
    max_batch = max(batches)
    results: dict = {"shape": asdict(shape), "batches": {}}
    prompts = {(b, r): random_prompts(b, args.prompt_len, shape.vocab_size, seed=1000 * b + r)
               for b in batches for r in range(args.repeats)}
    times: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], np.ndarray] = {}

    def record(variant: str, b: int, step_s: list[float], toks: np.ndarray) -> None:
        times.setdefault((variant, b), []).append(float(np.median(step_s)))
        tokens.setdefault((variant, b), toks)  # the first repeat's

    with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{name}-") as tmp:
        t0 = time.perf_counter()
        write_checkpoint(Path(tmp), shape, args.device)
        results["checkpoint_write_s"] = time.perf_counter() - t0
        print(f"[{name}] checkpoint written in {results['checkpoint_write_s']:.1f} s", flush=True)

        want = args.variants
        t0 = time.perf_counter()
        floor = Floor(tmp, args, max_batch)
        results["floor_setup_s"] = time.perf_counter() - t0
        for b in batches:
            for r in range(args.repeats):
                for graphs in (True, False):
                    if graphs or "floor_eager" in want:
                        record("floor" if graphs else "floor_eager", b, *floor.run(prompts[b, r], graphs))
        if args.device == "cuda":
            results["kernels_per_step"] = floor.kernels_per_step(prompts[batches[0], 0])
        floor.close()
        free_device(args.device)
        print(f"[{name}] floor done", flush=True)
        if args.device == "cuda" and "floor_unfused" in want:
            floor = Floor(tmp, args, max_batch, fused=False)
            for b in batches:
                for r in range(args.repeats):
                    record("floor_unfused", b, *floor.run(prompts[b, r], True))
            results["kernels_per_step_unfused"] = floor.kernels_per_step(prompts[batches[0], 0])
            floor.close()
            free_device(args.device)
            print(f"[{name}] floor_unfused done", flush=True)

        for variant, options in L3_VARIANTS.items():
            if variant not in want:
                continue
            l3 = L3(tmp, args, max_batch, **options)
            for b in batches:
                for r in range(args.repeats):
                    record(variant, b, *l3.run(prompts[b, r]))
            l3.close()
            print(f"[{name}] {variant} done", flush=True)

        if "hf_static" in want:
            hf = HFStatic(tmp, args)
            for b in batches:
                for r in range(args.repeats):
                    record("hf_static", b, *hf.run(prompts[b, r]))
            hf.close()
            free_device(args.device)
            print(f"[{name}] hf_static done", flush=True)

    context = args.prompt_len + (args.new_tokens - 1) / 2  # mean input position of the decode steps
    for b in batches:
        step_bytes = shape.step_bytes(b, context, 2)
        roofline_s = step_bytes / args.bandwidth
        row = {"step_bytes": step_bytes, "roofline_s": roofline_s, "variants": {}}
        for variant in VARIANTS:
            if (variant, b) not in times:
                continue
            t = statistics.median(times[variant, b])
            row["variants"][variant] = {
                "step_s": t, "step_s_per_repeat": times[variant, b], "tokens_sha": digest(tokens[variant, b], 12),
                "x_roofline": t / roofline_s, "achieved_bytes_per_s": step_bytes / t,
                "tokens_equal_floor": bool(np.array_equal(tokens[variant, b], tokens["floor", b])),
                "tokens_equal_reference": bool(np.array_equal(tokens[variant, b],
                                                              tokens.get((SAME_AS.get(variant, variant), b)))),
            }
        results["batches"][b] = row
    return results


VARIANTS = ("floor", "floor_eager", "floor_unfused", "l3", "l3_in_order", "l3_eager", "hf_static")
L3_VARIANTS = {"l3": dict(graphs=True), "l3_in_order": dict(graphs=True, overlap=False), "l3_eager": dict(graphs=False)}
# Each l3 variant runs the floor's code behind a chip-child: its tokens must be the floor's.
SAME_AS = {"l3": "floor", "l3_in_order": "floor", "l3_eager": "floor_eager"}


def format_table(all_results: dict) -> str:
    lines = ["| model | batch | roofline ms | floor ms | floor eager ms | floor unfused ms | l3 ms | l3 in-order ms "
             "| l3 eager ms | hf static ms | l3 / floor | in-order / floor | l3 / roofline | graphs speedup (l3) "
             "| fusion speedup (floor) | hf / l3 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for name, res in all_results["models"].items():
        for b, row in res["batches"].items():
            v = row["variants"]
            ms = lambda k: f"{v[k]['step_s'] * 1e3:.3f}" if k in v else "-"  # noqa: E731
            ratio = lambda a, c: f"{v[a]['step_s'] / v[c]['step_s']:.3f}" if a in v and c in v else "-"  # noqa: E731
            roof = f"{v['l3']['x_roofline']:.2f}" if "l3" in v else "-"
            lines.append(f"| {name} | {b} | {row['roofline_s'] * 1e3:.3f} | {ms('floor')} | {ms('floor_eager')} "
                         f"| {ms('floor_unfused')} | {ms('l3')} | {ms('l3_in_order')} | {ms('l3_eager')} "
                         f"| {ms('hf_static')} | {ratio('l3', 'floor')} | {ratio('l3_in_order', 'floor')} | {roof} "
                         f"| {ratio('l3_eager', 'l3')} | {ratio('floor_unfused', 'floor')} | {ratio('hf_static', 'l3')} |")
    for name, res in all_results["models"].items():
        if "kernels_per_step" in res:
            lines.append(f"{name}: kernels per decode step {res['kernels_per_step']} fused, "
                         f"{res.get('kernels_per_step_unfused', '-')} unfused ({res['shape']['num_hidden_layers']} layers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.6b,8b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; floor always runs")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = set(args.variants.split(",")) | {"floor"}
    if args.variants - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(args.variants - set(VARIANTS))}; choose from {VARIANTS}")
    models = args.models.split(",")
    for m in models:
        if m not in SHAPES:
            ap.error(f"--models: unknown model {m!r}; choose from {sorted(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")

    args.bandwidth = hbm_bandwidth(args.device)
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "bandwidth_bytes_per_s": args.bandwidth, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "page_size": args.page_size, "repeats": args.repeats}
    print(f"{info['device']}: copy bandwidth {args.bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    result = {"info": info, "models": {m: bench_model(m, args) for m in models}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    bad = [(m, b, v) for m, res in result["models"].items() for b, row in res["batches"].items()
           for v in SAME_AS if v in row["variants"] and SAME_AS[v] in row["variants"]
           and not row["variants"][v]["tokens_equal_reference"]]
    for m, b, v in bad:
        print(f"TOKENS DIFFER: {m} batch {b}: {v} vs {SAME_AS[v]}", file=sys.stderr)
    for m, res in result["models"].items():
        for b, row in res["batches"].items():
            same = [v for v, x in row["variants"].items() if x["tokens_equal_floor"]]
            print(f"{m} batch {b}: tokens equal to the floor's: {', '.join(same)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
