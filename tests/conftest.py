"""Shared fixtures: tiny random checkpoints written by transformers (Qwen3 unless another
family is named), and the built-in model."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import os

import pytest
import torch

# Triton's interpreter must be chosen before anything imports triton (transformers can, through
# torch._dynamo), so it is chosen here, once, for every test module that runs Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The built-in tiny model goes to a per-session cache, never the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("L3WORKER_CACHE", str(tmp_path_factory.mktemp("l3worker-cache")))
    yield
    mp.undo()


# family -> transformers' config and model class names
FAMILIES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def write_hf_checkpoint(path: Path, seed: int = 0, family: str = "qwen3", **overrides) -> Path:
    """A random checkpoint of `family` saved with save_pretrained; returns the directory. A key
    overridden with `...` is left to the config class's default."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    kwargs = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                  max_position_embeddings=512, eos_token_id=None)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{k: v for k, v in kwargs.items() if v is not ...})).eval()
    model.save_pretrained(path)
    return path


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
def served(tmp_path: Path):
    """served(*flags) -> a `l3worker serve` subprocess (server_helpers.Served), killed at the end."""
    from server_helpers import Served

    started: list[Served] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Served:
        s = Served(tmp_path / str(len(started)), *args, env=env)
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
        started.append(start_follower(model_dir, master_port, *flags, tmpdir=tmp_path / f"n{len(started)}"))
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
