"""`bench serve --plot`: a sweep of request rates as one PNG (matplotlib, the optional `plot` extra):
throughput, TTFT and ITL percentiles against the rate."""
from __future__ import annotations

import re
from pathlib import Path

MISSING = "--plot needs matplotlib, an optional extra: pip install 'l3worker[plot]' (or pip install matplotlib)"


def require_matplotlib():
    """matplotlib, or a RuntimeError naming the extra (checked before any request is sent)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MISSING) from None
    return matplotlib


def _x(results: list[dict]) -> tuple[list[float], list[str]]:
    """Positions and labels of the rates; inf sits one step past the highest finite rate."""
    finite = [float(r["request_rate"]) for r in results if r["request_rate"] != "inf"]
    inf_at = max(finite) * 2 if finite else 1.0
    xs = [inf_at if r["request_rate"] == "inf" else float(r["request_rate"]) for r in results]
    return xs, [f"{r['request_rate']:g}" if r["request_rate"] != "inf" else "inf" for r in results]


def _latency_keys(result: dict, metric: str) -> list[tuple[str, str]]:
    """(label, key) of the median and every saved percentile of a metric, as vLLM names them."""
    found = [(f"p{m.group(1)}", k) for k in result
             if (m := re.fullmatch(rf"p([\d.]+)_{metric}_ms", k)) and float(m.group(1)) != 50]  # p50 = median
    return [("p50", f"median_{metric}_ms"), *sorted(found, key=lambda lk: float(lk[0][1:]))]


def plot_sweep(results: list[dict], path: str | Path, title: str = "") -> Path:
    """One figure, three panels, the rates on a log axis; returns the PNG's path."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    xs, labels = _x(results)
    order = sorted(range(len(results)), key=xs.__getitem__)
    results, xs, labels = [results[i] for i in order], [xs[i] for i in order], [labels[i] for i in order]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    tput, ttft, itl = axes
    tput.plot(xs, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    tput.set_ylabel("output tokens/s")
    reqs = tput.twinx()
    reqs.plot(xs, [r["request_throughput"] for r in results], "s--", color="tab:orange", label="requests/s")
    reqs.set_ylabel("requests/s")
    tput.set_title("throughput")
    tput.legend(handles=tput.get_lines() + reqs.get_lines(), loc="upper left")
    for ax, metric, name in ((ttft, "ttft", "TTFT"), (itl, "itl", "ITL")):
        for label, key in _latency_keys(results[0], metric):
            ax.plot(xs, [r.get(key, float("nan")) for r in results], "o-", label=label)
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.legend(loc="upper left")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(xs, labels)
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s)")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
