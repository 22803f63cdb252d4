"""`l3worker bench serve | throughput | latency`: the argument parsers, with `vllm bench`'s flag
names and defaults, and the checks that turn a bad combination into exit status 2. Nothing heavy is
imported here: the parser is built on every `l3worker` call."""
from __future__ import annotations

import argparse
import sys

from l3worker.bench.checks import check_offline, check_serve
from l3worker.bench.datasets import DATASETS
from l3worker.bench.metrics import METRICS
from l3worker.bench.serve import BACKENDS, default_api_key

DEFAULT_PERCENTILE_METRICS = ",".join(METRICS)


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark a server or this runtime (vLLM's `vllm bench` flags)",
                                description="Benchmarks with vLLM's `vllm bench` flag names and result fields.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_args(sub.add_parser(
        "serve", help="load an OpenAI-compatible server with streaming requests",
        description="Streams requests to an OpenAI-compatible server (l3worker serve, vllm serve, ...) at a "
                    "Poisson rate and reports TTFT, TPOT, ITL, E2EL and throughput as vLLM's `bench serve` does."))
    add_throughput_args(sub.add_parser(
        "throughput", help="offline throughput of a DistributedWorker in this process",
        description="Runs every prompt through one DistributedWorker.generate call, as `vllm bench throughput`."))
    add_latency_args(sub.add_parser(
        "latency", help="end-to-end latency of one batch on a DistributedWorker in this process",
        description="Times one batch end to end, repeatedly, as `vllm bench latency`."))


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None,
                   help="sets the output length of every dataset (--random-output-len, --sharegpt-output-len, "
                        "--prefix-repetition-output-len)")
    g = p.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - ratio), len * (1 + ratio)]; ratio in [0, 1)")
    g.add_argument("--random-prefix-len", "--prefix-len", dest="random_prefix_len", type=int, default=0,
                   help="tokens of one prefix every prompt starts with, before its random part")
    g.add_argument("--token-range", type=int, nargs=2, default=(0, 256), metavar=("LOW", "HIGH"),
                   help="random prompt token ids are drawn from [LOW, HIGH) (l3worker; default: 0 256)")
    g = p.add_argument_group("sharegpt dataset")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="instead of the reply's length")
    g = p.add_argument_group("prefix_repetition dataset")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p)
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default: /v1/completions, or /v1/chat/completions for "
                                                    "--backend openai-chat")
    p.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or a checkpoint directory, to count sharegpt tokens (default: the "
                        "server's /tokenize)")
    p.add_argument("--api-key", default=default_api_key(), help="default: $OPENAI_API_KEY or $L3WORKER_API_KEY")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")], metavar="RATE",
                   help="requests/s (default: inf, all at once); several: one run each, a sweep")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="1: Poisson arrivals; lower: burstier, higher: more uniform (gamma gaps)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (always on for --dataset-name random)")
    p.add_argument("--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS,
                   help=f"comma-separated, of {', '.join(METRICS)} (default: all)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    p.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("sampling (sent only when given)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g = p.add_argument_group("results")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true", help="with per-request lists (ttfts, itls, ...)")
    g.add_argument("--result-dir", default=None, help="default: the current directory")
    g.add_argument("--result-filename", default=None,
                   help="default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json (a sweep adds -RATEqps to a given name)")
    g.add_argument("--label", default=None, help="file name prefix (default: --backend)")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the result JSON")
    g.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="draw throughput, TTFT and ITL against --request-rate as a PNG (default name: "
                        "LABEL-sweep[-concurrencyN]-MODEL-DATE.png in --result-dir); needs matplotlib")


def add_engine_args(p: argparse.ArgumentParser, prefix_caching: bool) -> None:
    g = p.add_argument_group("the worker (as `l3worker serve`'s flags)")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face Hub id (default: the built-in tiny model)")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-num-seqs", type=int, default=None, help="batch rows")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page; omitted: 16 on the CPU, 128 on NPUs and GPUs")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=prefix_caching)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p, prefix_caching=True)
    p.set_defaults(max_num_seqs=16)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the results here")
    # As in vLLM: the same prompts every iteration would otherwise be prefix-cache hits.
    add_engine_args(p, prefix_caching=False)


def bench_command(args: argparse.Namespace) -> int:
    """Runs `l3worker bench ...`: 2 for bad flags, 1 when the run fails or a request failed."""
    from l3worker.bench import commands

    name = f"l3worker bench {args.bench_command}"
    try:
        if args.bench_command == "serve":
            check_serve(args)
        else:
            check_offline(args)
    except ValueError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    run = {"serve": commands.serve, "throughput": commands.throughput, "latency": commands.latency}
    try:
        return run[args.bench_command](args)
    except commands.UsageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except (commands.RunError, OSError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
