"""The benchmark workloads, with vLLM's dataset names and length semantics: `random` (random token
ids), `sharegpt` (a local JSON file of conversations), `prefix_repetition` (a few shared prefixes,
each followed by random suffixes). Every sampler is seeded, so two runs send the same prompts."""
from __future__ import annotations

import json
import random as _random
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

DATASETS = ("random", "sharegpt", "prefix_repetition")
# ShareGPT conversations kept, as vLLM keeps them: prompt and completion of at least 4 tokens,
# a prompt of at most 1024, both together at most 2048.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (random datasets)
    prompt_len: int
    expected_output_len: int


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class DatasetConfig:
    """What the samplers read: the flags of `l3worker bench` under their vLLM names."""

    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    token_range: tuple[int, int] = (0, 256)  # random token ids are drawn from [low, high)

    def check(self) -> None:
        """ValueError naming the flag, before anything is sampled or sent."""
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.dataset_name!r}")
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        if self.dataset_name != "sharegpt" and self.dataset_path:
            raise ValueError(f"--dataset-path is only for --dataset-name sharegpt, not {self.dataset_name}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"--token-range must be 0 <= LOW < HIGH, got {low} {high}")
        lengths = {"--random-input-len": self.random_input_len, "--random-output-len": self.random_output_len,
                   "--prefix-repetition-output-len": self.prefix_repetition_output_len,
                   "--prefix-repetition-num-prefixes": self.prefix_repetition_num_prefixes}
        lengths |= {"--sharegpt-output-len": self.sharegpt_output_len} if self.sharegpt_output_len is not None else {}
        for flag, value in lengths.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.dataset_name == "prefix_repetition" and \
                self.prefix_repetition_prefix_len + self.prefix_repetition_suffix_len < 1:
            raise ValueError("--prefix-repetition-prefix-len + --prefix-repetition-suffix-len must be at least 1")
        if self.random_prefix_len < 0 or self.prefix_repetition_prefix_len < 0 or self.prefix_repetition_suffix_len < 0:
            raise ValueError("prefix and suffix lengths must be at least 0")


def get_samples(cfg: DatasetConfig, encoder: Encoder | None = None) -> list[SampleRequest]:
    """`cfg.num_prompts` requests of the named dataset; sharegpt needs an encoder to count tokens."""
    cfg.check()
    if cfg.dataset_name == "random":
        return random_samples(cfg)
    if cfg.dataset_name == "prefix_repetition":
        return prefix_repetition_samples(cfg)
    if encoder is None:
        raise ValueError("the sharegpt dataset needs a tokenizer to count prompt and completion tokens")
    return sharegpt_samples(cfg, encoder.encode)


def _ids(rng: np.random.Generator, cfg: DatasetConfig, n: int) -> list[int]:
    return rng.integers(cfg.token_range[0], cfg.token_range[1], n).tolist()


def random_samples(cfg: DatasetConfig) -> list[SampleRequest]:
    """A shared prefix of --random-prefix-len ids, then lengths uniform in len * (1 -/+ ratio)."""
    rng = np.random.default_rng(cfg.seed)

    def lengths(mean: int) -> np.ndarray:
        lo = max(1, int(np.floor(mean * (1 - cfg.random_range_ratio))))
        hi = max(lo, int(np.ceil(mean * (1 + cfg.random_range_ratio))))
        return rng.integers(lo, hi + 1, cfg.num_prompts)

    prefix = _ids(rng, cfg, cfg.random_prefix_len)
    ins, outs = lengths(cfg.random_input_len), lengths(cfg.random_output_len)
    out = []
    for n, m in zip(ins, outs):
        ids = prefix + _ids(rng, cfg, int(n))
        out.append(SampleRequest(ids, len(ids), int(m)))
    return out


def prefix_repetition_samples(cfg: DatasetConfig) -> list[SampleRequest]:
    """--prefix-repetition-num-prefixes prefixes, num_prompts // num_prefixes prompts each (the
    remainder from the first prefixes), each prefix + a random suffix; shuffled."""
    rng = np.random.default_rng(cfg.seed)
    prefixes = [_ids(rng, cfg, cfg.prefix_repetition_prefix_len) for _ in range(cfg.prefix_repetition_num_prefixes)]
    out = []
    for i in range(cfg.num_prompts):
        ids = prefixes[i % len(prefixes)] + _ids(rng, cfg, cfg.prefix_repetition_suffix_len)
        out.append(SampleRequest(ids, len(ids), cfg.prefix_repetition_output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_samples(cfg: DatasetConfig, encode: Callable[[str], list[int]]) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's token count as the output length (or
    --sharegpt-output-len); conversations shuffled by --seed; repeated if too few are kept."""
    with open(cfg.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{cfg.dataset_path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    convs = [e["conversations"] for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    _random.Random(cfg.seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) >= cfg.num_prompts:
            break
        prompt, completion = conv[0]["value"], conv[1]["value"]
        prompt_len = len(encode(prompt))
        output_len = cfg.sharegpt_output_len or len(encode(completion))
        if prompt_len < SHAREGPT_MIN_LEN or (cfg.sharegpt_output_len is None and output_len < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
    if not out:
        raise ValueError(f"{cfg.dataset_path}: no conversation fits (prompt and reply of at least "
                         f"{SHAREGPT_MIN_LEN} tokens, prompt at most {SHAREGPT_MAX_PROMPT_LEN})")
    rng = _random.Random(cfg.seed)
    out += [rng.choice(out) for _ in range(cfg.num_prompts - len(out))]  # vLLM oversamples the same way
    return out
