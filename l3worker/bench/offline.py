"""`bench throughput` and `bench latency`: a DistributedWorker in this process, as `vllm bench
throughput` and `vllm bench latency` run an LLM in theirs; their result fields under vLLM's names.
As there, every request ignores eos and samples at temperature 1 and top_p 1."""
from __future__ import annotations

import argparse
import time

import numpy as np

from l3worker.bench.datasets import DatasetConfig, get_samples
from l3worker.bench.tokenizer import LocalTokenizer

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)
LATENCY_TOKEN_IDS = 10000  # vLLM's latency prompts: ids below this (and below the vocabulary size)


def make_worker(args: argparse.Namespace, max_batch_size: int):
    """The worker the engine flags describe: --model a directory or a Hub id, as `l3worker serve`
    takes it; the built-in tiny model without one."""
    from chip_child.models.loader import load_config
    from chip_child.models.tiny_model import ensure_tiny_model
    from l3worker import DistributedWorker
    from l3worker.hub import resolve_model

    model_dir = resolve_model(args.model, what="--model") if args.model else str(ensure_tiny_model())
    max_model_len = args.max_model_len or min(4096, load_config(model_dir).max_position_embeddings)
    return DistributedWorker(args.model and model_dir, device=args.device, dtype=args.dtype,
                             max_batch_size=max_batch_size,
                             max_seq_len=max_model_len, page_size=args.block_size,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_prefix_caching=args.enable_prefix_caching)


def _params(n: int, max_new_tokens: int):
    from l3worker import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_new_tokens=max_new_tokens)


def throughput(args: argparse.Namespace, dataset: DatasetConfig) -> dict:
    """Every sample through one generate call; tokens counted from what came back."""
    with make_worker(args, args.max_num_seqs) as w:
        encoder = LocalTokenizer(w.tokenizer) if w.tokenizer is not None else None
        samples = get_samples(dataset, encoder)
        w.prepare()  # start-up and warm-up are not part of the timing
        t0 = time.perf_counter()
        outs = w.generate([s.prompt for s in samples], [_params(args.n, s.expected_output_len) for s in samples],
                          use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(s.token_ids) for o in outs for s in o.outputs)
    total = prompt_tokens + output_tokens
    return {"elapsed_time": elapsed, "num_requests": len(samples), "total_num_tokens": total,
            "requests_per_second": len(samples) / elapsed, "tokens_per_second": total / elapsed,
            "total_output_tokens": output_tokens, "output_tokens_per_second": output_tokens / elapsed}


def throughput_lines(result: dict) -> list[str]:
    return [f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
            f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s",
            f"Total num prompt tokens:  {result['total_num_tokens'] - result['total_output_tokens']}",
            f"Total num output tokens:  {result['total_output_tokens']}"]


def latency(args: argparse.Namespace) -> dict:
    """One batch of --batch-size random prompts, end to end, --num-iters times after the warm-up."""
    with make_worker(args, args.max_num_seqs or args.batch_size * args.n) as w:
        high = min(LATENCY_TOKEN_IDS, w.model_config.vocab_size)
        prompts = list(np.random.default_rng(args.seed).integers(0, high, (args.batch_size, args.input_len)))
        params = _params(args.n, args.output_len)
        w.prepare()
        latencies = []
        for i in range(args.num_iters_warmup + args.num_iters):
            t0 = time.perf_counter()
            w.generate(prompts, params, use_tqdm=False)
            if i >= args.num_iters_warmup:
                latencies.append(time.perf_counter() - t0)
    a = np.asarray(latencies)
    return {"avg_latency": float(a.mean()), "std_latency": float(a.std()), "latencies": a.tolist(),
            "percentiles": {p: float(v) for p, v in zip(LATENCY_PERCENTILES, np.percentile(a, LATENCY_PERCENTILES))}}


def latency_lines(result: dict) -> list[str]:
    return [f"Avg latency: {result['avg_latency']} seconds", f"Std latency: {result['std_latency']} seconds",
            *(f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items())]
