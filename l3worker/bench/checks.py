"""`l3worker bench`'s flag checks and the parsing of its list-valued flags: each bad value is a
ValueError naming the flag, which the command line prints with exit code 2."""
from __future__ import annotations

import argparse
from dataclasses import fields

from l3worker.bench.datasets import DatasetConfig
from l3worker.bench.metrics import METRICS


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    """The dataset flags, with --input-len / --output-len standing for each dataset's own."""
    values = {f.name: getattr(args, f.name) for f in fields(DatasetConfig)}
    values["token_range"] = tuple(args.token_range)
    if args.input_len is not None:
        values["random_input_len"] = args.input_len
    if args.output_len is not None:
        for name in ("random_output_len", "sharegpt_output_len", "prefix_repetition_output_len"):
            values[name] = args.output_len
    cfg = DatasetConfig(**values)
    cfg.check()
    return cfg


def _at_least(name: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in METRICS for n in names):
        raise ValueError(f"--percentile-metrics takes a comma-separated list of {', '.join(METRICS)}, got {text!r}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], got {text!r}")
    return values


def check_serve(args: argparse.Namespace) -> None:
    dataset_config(args)
    parse_percentile_metrics(args.percentile_metrics)
    parse_percentiles(args.metric_percentiles)
    _at_least("max_concurrency", args.max_concurrency, 1)
    if any(not r > 0 for r in args.request_rate):
        raise ValueError(f"--request-rate values must be positive (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {args.burstiness}")


def check_offline(args: argparse.Namespace) -> None:
    for name in ("n", "max_num_seqs", "batch_size", "num_iters", "input_len", "output_len"):
        _at_least(name, getattr(args, name, None), 1)
    _at_least("num_iters_warmup", getattr(args, "num_iters_warmup", None), 0)
    if args.bench_command == "throughput":
        dataset_config(args)
