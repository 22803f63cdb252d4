"""Shared fixtures: tiny random checkpoints written by transformers (Qwen3 unless another
family is named), and the built-in model."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import pytest
import torch

from checkpoints import write_hf_checkpoint

# Triton's interpreter must be chosen before anything imports triton (transformers can, through
# torch._dynamo), so it is chosen here, once, for every test module that runs Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Workers claim a step core machine-wide (l3worker.worker.cpu_placement.claim_core): each test process
# (pytest-xdist runs several) claims under a name of its own, so the tests that expect their worker
# to get a step core do not find it held by another test process's worker.
# Set, not defaulted: pytest-xdist's workers inherit the environment of the process that starts them.
os.environ["L3WORKER_CORE_CLAIMS"] = f"l3worker-tests-{os.getpid()}"

# A suite started in the background (`cmd &` in a script) inherits SIGINT ignored, and so would
# every program a test starts, so the Ctrl-C tests could not interrupt them. A handler here is
# reset to the default in those programs when they start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The built-in tiny model goes to a per-session cache, never the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("L3WORKER_CACHE", str(tmp_path_factory.mktemp("l3worker-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_checkpoint(name, seed, family, **config overrides) -> directory, cached per session by name."""
    made: dict[str, Path] = {}

    def make(name: str = "default", seed: int = 0, family: str = "qwen3", **overrides) -> Path:
        if name not in made:
            made[name] = write_hf_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"), seed, family, **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], "torch.nn.Module"]:
    """Loads a checkpoint directory with transformers in fp32, cached per directory."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def load(path: Path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load


@pytest.fixture
def served():
    """served(*flags) -> a `l3worker serve` subprocess (server_helpers.Served), killed at the end."""
    from server_helpers import Served

    started: list[Served] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Served:
        s = Served(*args, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def follower(tmp_path: Path):
    """follower(model_dir, master_port) -> a started follower node (node_helpers.start_follower);
    every one is killed at the end."""
    from node_helpers import kill_nodes, start_follower

    started: list = []

    def start(model_dir, master_port: int, *flags: str):
        started.append(start_follower(model_dir, master_port, *flags, log_dir=tmp_path / f"n{len(started)}"))
        return started[-1]

    yield start
    kill_nodes(started)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """The speculative-decoding tests' workload (spec_helpers), decoded without speculation."""
    from l3worker import DistributedWorker
    from spec_helpers import PARAMS, PROMPTS, SMALL, _tokens

    with DistributedWorker(**SMALL) as w:
        return _tokens(w.generate(PROMPTS, PARAMS))
