"""scripts/bench_served_peers.sh's checks before it starts anything: the engine `base` (l3worker from
another checkout) needs BASE_TREE to be one. The runs themselves need the peers kit, which CI does not
install."""
from __future__ import annotations

import os
import subprocess
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
