"""Server-wide sampling defaults (vLLM's --generation-config): for the fields a request leaves out,
the checkpoint's generation_config.json (`auto`, the default), vLLM's own neutral values (`vllm`),
or the generation_config.json in another folder (a path). Also --seed's stream of per-request
seeds for requests that give none."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"
MAX_SEED = 2**63  # SamplingParams' bound


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for fields a request leaves out; `source` says where they came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "vllm"  # "vllm" (the neutral values) or the generation_config.json they were read from

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "GenerationDefaults":
        """The checkpoint's generation_config.json; the neutral values when it has none."""
        path = Path(model_dir) / GENERATION_CONFIG
        return cls.from_file(path) if path.is_file() else cls()

    @classmethod
    def from_file(cls, path: str | Path) -> "GenerationDefaults":
        with Path(path).open(encoding="utf-8") as f:
            raw = json.load(f)
        found = {k: raw[k] for k in _DEFAULTABLE
                 if isinstance(raw, dict) and isinstance(raw.get(k), (int, float)) and not isinstance(raw[k], bool)}
        return cls(**found, source=str(path)) if found else cls()

    @classmethod
    def for_option(cls, option: str, model_dir: str | Path) -> "GenerationDefaults":
        """--generation-config: auto | vllm | a folder holding generation_config.json (or that file).
        ValueError naming the flag for a path that holds none."""
        if option == "auto":
            return cls.from_model_dir(model_dir)
        if option == "vllm":
            return cls()
        path = Path(option).expanduser()
        if path.is_dir():
            path = path / GENERATION_CONFIG
        if not path.is_file():
            raise ValueError(f"--generation-config {option!r}: no {GENERATION_CONFIG} there (give auto, vllm or a "
                             "folder holding one)")
        try:
            return cls.from_file(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"--generation-config {option!r}: cannot read {path}: {e}") from None

    def overrides(self) -> dict[str, float]:
        """The fields that differ from the neutral defaults (for the start-up line)."""
        return {k: getattr(self, k) for k in _DEFAULTABLE if getattr(self, k) != getattr(GenerationDefaults, k)}

    def describe(self) -> str:
        values = " ".join(f"{k}={v}" for k, v in self.overrides().items())
        return f"sampling defaults {values} from {self.source}" if values else "sampling defaults: vllm's"


_DEFAULTABLE = tuple(f.name for f in fields(GenerationDefaults) if f.name != "source")


class RequestSeeds:
    """--seed: the seed of each request that gives none, drawn from one generator seeded once, as
    vLLM seeds its sampler once: a server restarted with the same seed answers the same sequence
    of requests the same way, while two requests in a row still differ. None: unseeded."""

    def __init__(self, seed: int | None = None):
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < MAX_SEED):
            raise ValueError(f"--seed must be an integer in [0, 2**63), got {seed!r}")
        self.seed = seed
        self._rng = random.Random(seed) if seed is not None else None

    def next(self) -> int | None:
        return self._rng.randrange(MAX_SEED) if self._rng is not None else None
