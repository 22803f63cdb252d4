"""examples/npu_generate.py run as a user runs it: a subprocess from the repository root."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "npu_generate.py"
SMALL = ["--max-seq-len", "64", "--max-new-tokens", "6", "--block-size", "8", "--max-num-seqs", "4"]
SETUP_RE = re.compile(r"^\[setup\] prepared in \d+\.\d{3}s on cpu \(float32\)$")
REQUEST_RE = re.compile(r"^\[setup\] request (\d+): \d+\.\d{4}s")
OVERALL_RE = re.compile(r"^\[perf\] generated (\d+) tokens in \d+\.\d{3}s -> \d+\.\d{2} tok/s \(overall, incl\. prefill\)$")
DECODE_RE = re.compile(r"^\[perf\] prefill/TTFT \d+\.\d{3}s \| decode \d+\.\d{3}s over (\d+) steps -> "
                       r"\d+\.\d{2} tok/s \(\d+\.\d{2} ms/token\)$")
PROFILE_LABELS = ("parent wall (ms)", "parent wait (ms)", "child apply (ms)", "device time (ms)", "command bytes",
                  "H2D copies", "H2D bytes", "pool allocations")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def lines(text: str, prefix: str) -> list[str]:
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


def check_request_output(stdout: str, prompts: int, requests: int, max_new: int) -> list[list[int]]:
    """The per-prompt and perf lines of `requests` generate calls; returns every token_ids list."""
    ids = [eval(line) for line in lines(stdout, "token_ids: ")]  # noqa: S307 (our own printed lists)
    assert len(ids) == prompts * requests
    assert len(lines(stdout, "text: ")) == prompts * requests
    assert set(lines(stdout, "finish_reason: ")) <= {"length", "stop"}
    assert len(lines(stdout, "finish_reason: ")) == prompts * requests
    assert all(1 <= len(t) <= max_new for t in ids)
    out = stdout.splitlines()
    assert sum(bool(SETUP_RE.match(line)) for line in out) == 1
    assert [int(m[1]) for line in out if (m := REQUEST_RE.match(line))] == list(range(1, requests + 1))
    overall = [int(m[1]) for line in out if (m := OVERALL_RE.match(line))]
    per_request = [sum(len(t) for t in ids[i * prompts:(i + 1) * prompts]) for i in range(requests)]
    assert overall == per_request
    assert len([line for line in out if DECODE_RE.match(line)]) == requests
    return ids


def test_no_arguments_uses_builtin_model() -> None:
    res = run()
    assert res.returncode == 0, res.stderr
    check_request_output(res.stdout, prompts=4, requests=1, max_new=32)
    texts = lines(res.stdout, "text: ")
    assert all(t.startswith("'") for t in texts)  # a str repr, not None: the tiny model has a tokenizer


def test_stream_prints_deltas_that_add_up_to_each_final_text() -> None:
    res = run(*SMALL, "--stream", "--num-prompts", "3")
    assert res.returncode == 0, res.stderr
    check_request_output(res.stdout, prompts=3, requests=1, max_new=6)
    streamed: dict[str, str] = {}
    for line in res.stdout.splitlines():
        if m := re.match(r"^\[(\d+)\] (.*)$", line):
            streamed[m[1]] = streamed.get(m[1], "") + eval(m[2])  # noqa: S307 (our own printed reprs)
    finals = [eval(t) for t in lines(res.stdout, "text: ")]  # noqa: S307
    assert [streamed.get(str(i), "") for i in range(3)] == finals


def test_checkpoint_without_tokenizer_default_prompts(make_checkpoint) -> None:
    res = run("--model-dir", str(make_checkpoint("default")), "--num-prompts", "3", "--requests", "3", "--profile",
              *SMALL)
    assert res.returncode == 0, res.stderr
    ids = check_request_output(res.stdout, prompts=3, requests=3, max_new=6)
    assert lines(res.stdout, "text: ") == ["None"] * 9
    assert ids[:3] == ids[3:6] == ids[6:]  # greedy: the same each request
    # Every prompt gets all 6 tokens (no eos in this checkpoint) and they run together: 5 decode steps.
    assert [int(m[1]) for line in res.stdout.splitlines() if (m := DECODE_RE.match(line))] == [5, 5, 5]
    for label in PROFILE_LABELS:
        rows = lines(res.stdout, f"[profile] {label}")
        assert len(rows) == 3, label
        assert all(len(row.split()) == 3 for row in rows)
    assert all(row.split() == ["0.000"] * 3 for row in lines(res.stdout, "[profile] pool allocations"))


def test_token_id_prompts_match_transformers(make_checkpoint, hf_model) -> None:
    path = make_checkpoint("default")
    prompts = [[5, 17, 42, 7], [250]]
    res = run("--model-dir", str(path), *[a for p in prompts for a in ("--prompt", ",".join(map(str, p)))],
              *SMALL)
    assert res.returncode == 0, res.stderr
    ids = check_request_output(res.stdout, prompts=2, requests=1, max_new=6)
    model = hf_model(path)
    for got, prompt in zip(ids, prompts):
        x = torch.tensor([prompt])
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert got == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("args,match", [
    (["--max-new-tokens", "0"], r"^error: .*max_tokens"),
    (["--top-p", "1.5"], r"^error: .*top_p"),
    (["--copy-policy", "sometimes"], r"error: argument --copy-policy"),
    (["--device-ids", "zero"], r"error: argument --device-ids"),
], ids=["max-new-tokens 0", "top-p 1.5", "unknown copy policy", "device-ids not ints"])
def test_bad_flag_exits_2_with_error_line(args: list[str], match: str) -> None:
    res = run(*args)
    assert res.returncode == 2
    assert any(re.search(match, line) for line in res.stderr.splitlines()), res.stderr
    assert "Traceback" not in res.stderr
    assert not lines(res.stdout, "[setup]")  # rejected before any child started
