"""`l3worker bench serve | throughput | latency` as a user runs them (in-process through the CLI's main):
vLLM's flag names and result fields, exact lengths with ignore_eos, the datasets, saving and the sweep
plot, and bad flags. No timing is asserted: the figures are for people."""
from __future__ import annotations

import json
import os
import sys

import psutil
import pytest

from l3worker import DistributedWorker
from l3worker.bench.datasets import DatasetConfig, get_samples
from l3worker.serving.cli import main
from l3worker.serving.runner import ServeOptions, ServerThread

SERVE_FIELDS = {"date", "backend", "label", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput",
                *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                  for stat in ("mean", "median", "std", "p99"))}
ENGINE = ["--max-model-len", "64", "--block-size", "16", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server():
    worker = DistributedWorker(None, max_batch_size=4, max_seq_len=128, page_size=16)
    with ServerThread(worker, options=ServeOptions(port=0)) as srv:
        pids, socket_dir = worker.child_pids, worker.socket_dir
        assert pids and socket_dir
        yield srv
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not os.path.exists(socket_dir)


def run(*argv: str) -> int:
    """main()'s exit status, whether it returns it or argparse exits."""
    try:
        return main(["bench", *argv])
    except SystemExit as e:
        return e.code


def test_serve_random_has_vllm_fields_and_exact_lengths(server, tmp_path) -> None:
    rc = run("serve", "--base-url", server.url, "--num-prompts", "5", "--input-len", "12", "--output-len", "6",
             "--ignore-eos", "--max-concurrency", "2", "--request-rate", "100", "--disable-tqdm", "--save-result",
             "--save-detailed", "--result-dir", str(tmp_path / "out"), "--result-filename", "run.json")
    assert rc == 0
    result = json.loads((tmp_path / "out" / "run.json").read_text())
    assert SERVE_FIELDS <= set(result)
    assert (result["completed"], result["failed"], result["num_prompts"]) == (5, 0, 5)
    assert (result["model_id"], result["request_rate"], result["max_concurrency"]) == ("l3worker-tiny", 100.0, 2)
    assert result["output_lens"] == [6] * 5 and result["input_lens"] == [12] * 5
    assert (result["total_output_tokens"], result["total_input_tokens"]) == (30, 60)
    assert all(len(itl) == 5 for itl in result["itls"])  # one streamed chunk per token after the first
    assert result["median_ttft_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"] > 0
    assert result["output_throughput"] == pytest.approx(30 / result["duration"])


def test_serve_sharegpt_file_through_chat(server, tmp_path) -> None:
    """A local ShareGPT file, counted by the server's /tokenize (the tiny tokenizer: one token per
    byte); conversations of one turn or a prompt under 4 tokens are left out, as vLLM does."""
    convs = [("What is the capital of France?", "Paris, mostly."), ("Name three colours", "red green blue"),
             ("hi", "this prompt is too short"), ("Count to five please", "one two three four five")]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate(convs)] + [{"id": "x", "conversations": [{"from": "human", "value": "alone"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rc = run("serve", "--base-url", server.url, "--backend", "openai-chat", "--dataset-name", "sharegpt",
             "--dataset-path", str(path), "--num-prompts", "3", "--ignore-eos", "--disable-tqdm", "--save-result",
             "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "chat.json")
    assert rc == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    kept = [c for c in convs if len(c[0]) >= 4]
    assert (result["completed"], result["failed"], result["backend"]) == (3, 0, "openai-chat")
    assert sorted(zip(result["input_lens"], result["output_lens"])) == sorted((len(q), len(a)) for q, a in kept)


def test_datasets_random_prefix_and_prefix_repetition() -> None:
    cfg = DatasetConfig(num_prompts=20, random_input_len=10, random_output_len=8, random_range_ratio=0.5,
                        random_prefix_len=4, token_range=(5, 50))
    samples = get_samples(cfg)
    assert len({tuple(s.prompt[:4]) for s in samples}) == 1
    assert all(4 + 5 <= s.prompt_len == len(s.prompt) <= 4 + 15 and 4 <= s.expected_output_len <= 12 for s in samples)
    assert all(5 <= t < 50 for s in samples for t in s.prompt)
    assert [s.prompt for s in get_samples(cfg)] == [s.prompt for s in samples]  # seeded
    rep = get_samples(DatasetConfig(dataset_name="prefix_repetition", num_prompts=12, prefix_repetition_prefix_len=6,
                                    prefix_repetition_suffix_len=3, prefix_repetition_num_prefixes=3,
                                    prefix_repetition_output_len=5, token_range=(0, 1000)))
    assert all(s.prompt_len == 9 and s.expected_output_len == 5 for s in rep)
    prefixes = [tuple(s.prompt[:6]) for s in rep]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))


def test_sweep_saves_each_rate_and_plots(server, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    rc = run("serve", "--base-url", server.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
             "--request-rate", "50", "inf", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "s.json", "--plot", str(png))
    assert rc == 0
    rates = [json.loads((tmp_path / f"s-{r}qps.json").read_text())["request_rate"] for r in ("50.0", "inf")]
    assert rates == [50.0, "inf"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert run("serve", "--base-url", "http://127.0.0.1:1", "--plot") == 2
    assert "l3worker[plot]" in capsys.readouterr().err


def test_throughput_in_process(tmp_path) -> None:
    out = tmp_path / "t.json"
    assert run("throughput", "--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--n", "2",
               "--disable-tqdm", "--output-json", str(out), *ENGINE) == 0
    result = json.loads(out.read_text())
    # 6 prompts of 10 tokens, each with 2 samples of 5 tokens
    assert (result["num_requests"], result["total_num_tokens"], result["total_output_tokens"]) == (6, 120, 60)
    assert result["requests_per_second"] == pytest.approx(6 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(120 / result["elapsed_time"])


def test_latency_in_process(tmp_path) -> None:
    out = tmp_path / "l.json"
    assert run("latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1",
               "--num-iters", "3", "--output-json", str(out), *ENGINE) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["serve", "--dataset-path", "x.json"], "only for --dataset-name sharegpt"),
    (["serve", "--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
    (["serve", "--request-rate", "0"], "--request-rate values must be positive"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["serve", "--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["serve", "--metric-percentiles", "150"], "--metric-percentiles"),
    (["serve", "--dataset-name", "sonnet"], "invalid choice: 'sonnet'"),
    (["serve", "--num-prompts", "many"], "invalid int value"),
    (["latency", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["throughput", "--output-len", "0"], "must be at least 1"),
])
def test_bad_flags_exit_2_with_a_message(argv, message, capsys) -> None:
    assert run(*argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_1(capsys) -> None:
    assert run("serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1") == 1
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err
