"""What each `l3worker bench` command does once its flags are checked: sample the dataset, run,
print the result as vLLM prints it, save it (and, for a sweep, plot it)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import httpx

from l3worker.bench import offline
from l3worker.bench.checks import dataset_config, parse_percentile_metrics, parse_percentiles
from l3worker.bench.datasets import SampleRequest, get_samples
from l3worker.bench.metrics import RequestResult, detailed, report_lines, summarize
from l3worker.bench.serve import LoadConfig, auth_headers, first_model, run_load
from l3worker.bench.tokenizer import LocalTokenizer, ServerTokenizer


class UsageError(ValueError):
    """Flags that only turn out wrong once the run starts (exit status 2)."""


class RunError(RuntimeError):
    """The server could not be reached or the run failed (exit status 1)."""


# -- serve ------------------------------------------------------------------------------------------------
def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def endpoint_of(args: argparse.Namespace) -> str:
    return args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")


def serve_samples(args: argparse.Namespace, base_url: str, model: str) -> list[SampleRequest]:
    """The dataset's requests; token-id prompts become text for the chat endpoint."""
    tok = LocalTokenizer.from_path(args.tokenizer) if args.tokenizer else \
        ServerTokenizer(base_url, model, auth_headers(args.api_key))
    try:
        samples = get_samples(dataset_config(args), tok)
        if args.backend == "openai-chat":
            samples = [replace(s, prompt=tok.decode(s.prompt)) if isinstance(s.prompt, list) else s for s in samples]
    finally:
        tok.close()
    return samples


def serve_once(args: argparse.Namespace, base_url: str, model: str, samples: list[SampleRequest],
               rate: float) -> tuple[dict, list[RequestResult]]:
    """One run at one request rate: vLLM's result JSON (configuration, then the metrics) and the
    per-request results."""
    sampling = {k: v for k in ("temperature", "top_p", "top_k", "min_p") if (v := getattr(args, k)) is not None}
    cfg = LoadConfig(base_url=base_url, model=model, endpoint=endpoint_of(args), backend=args.backend,
                     api_key=args.api_key, request_rate=rate, burstiness=args.burstiness,
                     max_concurrency=args.max_concurrency, sampling=sampling, seed=args.seed,
                     # vLLM's random dataset always ignores eos, so every request runs to its length
                     ignore_eos=args.ignore_eos or args.dataset_name == "random", disable_tqdm=args.disable_tqdm)
    try:
        outputs, duration = asyncio.run(run_load(cfg, samples))
    except RuntimeError as e:
        raise RunError(str(e)) from None
    metadata = dict(item.split("=", 1) for item in args.metadata or [] if "=" in item)
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
              "backend": args.backend, "label": args.label, "model_id": model, "tokenizer_id": args.tokenizer,
              "num_prompts": args.num_prompts, **metadata, "request_rate": rate if rate != math.inf else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              **summarize(outputs, duration, parse_percentile_metrics(args.percentile_metrics),
                          parse_percentiles(args.metric_percentiles))}
    if args.save_detailed:
        result |= detailed(outputs)
    return result, outputs


def _stem(args: argparse.Namespace, model: str, what: str, date: str) -> str:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    return f"{args.label or args.backend}-{what}{concurrency}-{model.split('/')[-1]}-{date}"


def result_path(args: argparse.Namespace, model: str, rate: float, date: str, sweep: bool) -> Path:
    """vLLM's name, LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, or --result-filename (with
    -RATEqps before its suffix in a sweep), in --result-dir."""
    if args.result_filename:
        name = Path(args.result_filename)
        if sweep:
            name = name.with_name(f"{name.stem}-{rate}qps{name.suffix}")
    else:
        name = Path(_stem(args, model, f"{rate}qps", date) + ".json")
    return Path(args.result_dir or ".") / name


def write_json(path: str | Path, result: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def serve(args: argparse.Namespace) -> int:
    if args.plot is not None:
        from l3worker.bench.plot import require_matplotlib

        try:
            require_matplotlib()  # before any request is sent
        except RuntimeError as e:
            raise UsageError(str(e)) from None
    base_url = base_url_of(args)
    try:
        model = args.model or first_model(base_url, args.api_key)
        samples = serve_samples(args, base_url, model)
    except httpx.HTTPError as e:
        raise RunError(f"cannot reach {base_url}: {e}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    sweep = len(args.request_rate) > 1
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    results = []
    for rate in args.request_rate:
        print(f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness}\n"
              f"Maximum request concurrency: {args.max_concurrency}", flush=True)
        result, outputs = serve_once(args, base_url, model, samples, rate)
        print("\n".join(report_lines(result, percentile_metrics, percentiles)), flush=True)
        for error in sorted({o.error for o in outputs if not o.success})[:5]:
            print(f"  error: {error}")
        if args.save_result:
            print(f"saved {write_json(result_path(args, model, rate, date, sweep), result)}")
        results.append(result)
    if args.plot is not None:
        from l3worker.bench.plot import plot_sweep

        png = args.plot or Path(args.result_dir or ".") / (_stem(args, model, "sweep", date) + ".png")
        print(f"plotted {plot_sweep(results, png, title=f'{model}, {args.dataset_name}')}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


# -- offline ----------------------------------------------------------------------------------------------
def _offline(args: argparse.Namespace, run, lines) -> int:
    try:
        result = run()
    except (ValueError, TypeError) as e:  # the worker refuses what can never fit, naming the limit
        raise UsageError(str(e)) from None
    print("\n".join(lines(result)))
    if args.output_json:
        print(f"saved {write_json(args.output_json, result)}")
    return 0


def throughput(args: argparse.Namespace) -> int:
    return _offline(args, lambda: offline.throughput(args, dataset_config(args)), offline.throughput_lines)


def latency(args: argparse.Namespace) -> int:
    return _offline(args, lambda: offline.latency(args), offline.latency_lines)
