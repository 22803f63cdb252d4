"""scripts/bench_served_peers.sh's checks before it starts anything: a load or an engine it does not
know is refused by name, and the engine `base` (l3worker from another checkout) needs BASE_TREE to be
one. The runs themselves need the peers kit, which CI does not install."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_served_peers.sh"


@pytest.fixture
def build(tmp_path: Path) -> dict[str, str]:
    """A peers build and an l3worker venv with the files the driver looks for, and nothing else."""
    for path in ("peers/vllm-venv/bin/vllm", "peers/ck-27m/config.json", "venv/bin/l3worker"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    return {**os.environ, "PEERS_BUILD": str(tmp_path / "peers"), "LV": str(tmp_path / "venv"), "LOADS": "c1"}


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "27m"], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("base_tree", [None, "missing", "not-a-checkout"])
def test_the_engine_base_is_refused_without_a_checkout(build: dict[str, str], tmp_path: Path,
                                                      base_tree: str | None) -> None:
    env = {**build, "ENGINES": "l3worker base"}
    env.pop("BASE_TREE", None)
    if base_tree:
        env["BASE_TREE"] = str(tmp_path / base_tree)
        if base_tree == "not-a-checkout":
            (tmp_path / base_tree).mkdir()
    result = run(env)
    assert result.returncode == 2
    assert "the engine base needs BASE_TREE" in result.stderr
    assert not (tmp_path / "peers" / "served" / "base-1").exists()  # nothing was started


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("LOADS", "c1 c16", "unknown load c16 in LOADS"),
    ("ENGINES", "l3worker llamacpp", "unknown engine llamacpp in ENGINES"),
    ("ENGINES", "l3worker-si", "unknown engine l3worker-si in ENGINES"),
])
def test_an_unknown_load_or_engine_is_refused_by_name(build: dict[str, str], tmp_path: Path, variable: str,
                                                     value: str, message: str) -> None:
    """Before, a load it did not know was skipped: the run measured nothing and its last step failed."""
    result = run({**build, "ENGINES": "l3worker", variable: value})
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "peers" / "served").exists()  # nothing was started


@pytest.mark.parametrize("engines", ["l3worker-inline l3worker-si4 vllm", "llama"])
def test_the_known_engines_pass_the_checks(build: dict[str, str], tmp_path: Path, engines: str) -> None:
    """Past the checks the driver makes its served/ folder, then converts the checkpoint for llama.cpp
    (no build here) or starts an engine (a stub venv's l3worker that cannot run): it fails there,
    not with a refusal."""
    result = run({**build, "ENGINES": engines})
    assert result.returncode != 0 and "unknown" not in result.stderr
    assert (tmp_path / "peers" / "served").is_dir()


STUB_SERVER = """#!{python}
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.environ["ORDER_FILE"], "a") as f:  # base puts its checkout first on PYTHONPATH
    f.write(("base" if os.environ.get("PYTHONPATH", "").startswith(os.environ["BASE_TREE"]) else "l3worker") + "\\n")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
STUB_CLIENT = """#!/bin/sh
printf 'Output token throughput (tok/s): 1\\nMedian TTFT (ms): 1\\nMedian TPOT (ms): 1\\n'
printf 'P99 ITL (ms): 1\\nFailed requests: 0\\nRequest throughput (req/s): 0.5\\n'
"""


def test_every_other_round_runs_the_engines_in_reverse(build: dict[str, str], tmp_path: Path) -> None:
    """Stub engines (a /health server in place of l3worker serve, a client that prints fixed figures):
    rounds 1 and 3 start l3worker then base, round 2 base then l3worker, so neither always goes first."""
    for path, text in (("venv/bin/l3worker", STUB_SERVER.format(python=sys.executable)),
                       ("peers/vllm-venv/bin/vllm", STUB_CLIENT)):
        (tmp_path / path).write_text(text)
        (tmp_path / path).chmod(0o755)
    (tmp_path / "venv/bin/python").symlink_to(sys.executable)  # the driver's ratios at the end
    (tmp_path / "base" / "l3worker").mkdir(parents=True)
    order = tmp_path / "order.txt"
    result = run({**build, "ENGINES": "l3worker base", "REPEATS": "3", "BASE_TREE": str(tmp_path / "base"),
                  "ORDER_FILE": str(order)})
    assert result.returncode == 0, result.stderr
    assert order.read_text().split() == ["l3worker", "base", "base", "l3worker", "l3worker", "base"]
    assert "| 1 client: TPOT p50 | 1.00, 1.00, 1.00 (median 1.00) |" in result.stdout
    assert "| 1 client: time a token, from the run's duration | 1.00, 1.00, 1.00 (median 1.00) |" in result.stdout


def test_a_client_that_prints_no_figures_leaves_empty_fields_and_no_server(build: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """A load whose client failed is a row of empty fields; the run goes on and stops every server."""
    (tmp_path / "venv/bin/l3worker").write_text(STUB_SERVER.format(python=sys.executable))
    (tmp_path / "peers/vllm-venv/bin/vllm").write_text("#!/bin/sh\necho 'the client failed' >&2; exit 1\n")
    for path in ("venv/bin/l3worker", "peers/vllm-venv/bin/vllm"):
        (tmp_path / path).chmod(0o755)
    (tmp_path / "venv/bin/python").symlink_to(sys.executable)  # the driver's ratios at the end
    (tmp_path / "base" / "l3worker").mkdir(parents=True)
    result = run({**build, "ENGINES": "l3worker base", "BASE_TREE": str(tmp_path / "base"),
                  "ORDER_FILE": str(tmp_path / "order.txt")})
    assert result.returncode == 0, result.stderr
    rows = (tmp_path / "peers/served/figures.tsv").read_text().splitlines()
    assert [row.split("\t")[:3] for row in rows] == [["l3worker", "1", "c1"], ["base", "1", "c1"]]
    assert all(row.split("\t")[3:8] == [""] * 5 for row in rows)
    with socket.socket() as s:  # the driver's port: free again
        assert s.connect_ex(("127.0.0.1", 8110)) != 0
