"""Per-request timings of a serving run and their summary, under vLLM's result field names
(`completed`, `request_throughput`, `mean_ttft_ms`, `median_itl_ms`, `p99_e2el_ms`, ...), so a
result compares one to one with `vllm bench serve`'s."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_LABELS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from perf_counter."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)  # between successive streamed chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(latency - ttft) / (output tokens - 1), as vLLM defines it; None for one token."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": the `p{word}_ttft_ms` key vLLM writes."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(outputs: list[RequestResult], duration_s: float, percentile_metrics: tuple[str, ...] = METRICS,
              percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """vLLM's result fields: counts, throughputs, and mean / median / std / p{N} in ms of each
    selected metric over the successful requests (0 where there is nothing to measure, as vLLM)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    result = {
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    values = {"ttft": [o.ttft for o in ok], "tpot": [t for o in ok if (t := o.tpot) is not None],
              "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok]}
    for name in percentile_metrics:
        ms = np.asarray(values[name] or [0.0]) * 1e3
        result[f"mean_{name}_ms"] = float(ms.mean())
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def detailed(outputs: list[RequestResult]) -> dict:
    """The per-request lists vLLM saves with --save-detailed."""
    return {"input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "start_times": [o.start_time for o in outputs], "errors": [o.error for o in outputs]}


def report_lines(result: dict, percentile_metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> list[str]:
    """The result as vLLM prints it, one `label: value` line each."""
    def row(label: str, value, fmt: str = "") -> str:
        return f"{label:<40} {value:{fmt}}"

    lines = ["{s:=^50}".format(s=" Serving Benchmark Result "),
             row("Successful requests:", result["completed"]), row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(row("Request rate configured (RPS):", result["request_rate"], ".2f"))
    lines += [row("Benchmark duration (s):", result["duration"], ".2f"),
              row("Total input tokens:", result["total_input_tokens"]),
              row("Total generated tokens:", result["total_output_tokens"]),
              row("Request throughput (req/s):", result["request_throughput"], ".2f"),
              row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
              row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    for name in percentile_metrics:
        short, header = _LABELS[name]
        lines += ["{s:-^50}".format(s=header), row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f"),
                  row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")]
        lines += [row(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{name}_ms"], ".2f")
                  for p in percentiles]
    lines.append("=" * 50)
    return lines
