"""Structured-output costs: grammar compile (first and cached) and the per-token mask fill.

    PYTHONPATH=$PWD python scripts/bench_grammar.py [--vocab 320 151936] [--repeats 3]

Vocab 320 is the built-in tiny model's byte-level tokenizer; a larger size is a synthetic
byte-level BPE vocabulary of that many tokens (word pieces with and without a leading space,
digits, punctuation runs), as a stand-in for Qwen3's 151936. The mask is filled at every token of a
typical JSON reply walked under its schema; figures are the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from chip_child.models.tiny_model import ensure_tiny_model
from chip_child.sampling.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from l3worker.structured.specs import StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "roles", "address", "score", "active"],
    "additionalProperties": False,
}
REPLY = json.dumps({"id": 42, "name": "Ada Lovelace", "email": "ada@example.com", "roles": ["admin", "viewer"],
                    "address": {"city": "London", "zip": "12345"}, "score": 9.5, "active": True})


def synthetic_tokenizer(size: int, out: Path) -> tuple[Path, int]:
    """A byte-level BPE vocabulary of `size` tokens (no merges: it only has to be a vocabulary)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    rng = random.Random(0)
    letters, pieces = "abcdefghijklmnopqrstuvwxyz", ["Ġ", "", "", "Ċ"]
    while len(vocab) < size - 1:
        kind = rng.random()
        if kind < 0.8:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            tok = rng.choice(pieces) + (word.capitalize() if rng.random() < 0.2 else word)
        elif kind < 0.9:
            tok = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 3)))
        else:
            tok = "".join(rng.choice('{}[]",:.()-_/Ġ') for _ in range(rng.randint(2, 4)))
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path = out / f"tokenizer-{size}.json"
    tok.save(str(path))
    return path, tok.token_to_id("<|endoftext|>")


def bench(path: Path, vocab_size: int, eos: int) -> dict[str, float]:
    t0 = time.perf_counter()
    compiler = GrammarCompiler(path, vocab_size, [eos])
    tokenizer_s = time.perf_counter() - t0
    spec = StructuredSpec.from_request(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(spec)
    cached_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = compiled.matcher()
    matcher_s = time.perf_counter() - t0
    ids = Tokenizer.from_file(str(path)).encode(REPLY).ids
    mask = allocate_bitmask(1, vocab_size)
    fills = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_bitmask(mask[0])
        fills.append(time.perf_counter() - t0)
        assert matcher.accept(token), matcher.error
    logits = torch.randn(64, vocab_size)
    masks = mask.expand(64, -1).contiguous()
    t0 = time.perf_counter()
    for _ in range(10):
        apply_bitmask(logits, masks)
    apply_s = (time.perf_counter() - t0) / 10
    compiler.close()
    fills.sort()
    return {"tokenizer_ms": tokenizer_s * 1e3, "compile_first_ms": first_s * 1e3, "compile_cached_us": cached_s * 1e6,
            "matcher_copy_us": matcher_s * 1e6, "fill_mean_us": statistics.mean(fills) * 1e6,
            "fill_p50_us": fills[len(fills) // 2] * 1e6, "fill_p99_us": fills[int(len(fills) * 0.99)] * 1e6,
            "apply_b64_cpu_ms": apply_s * 1e3, "tokens": len(ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[320, 151936])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.vocab:
            if size == 320:
                d = ensure_tiny_model()
                path, eos = d / "tokenizer.json", json.loads((d / "config.json").read_text())["eos_token_id"]
            else:
                path, eos = synthetic_tokenizer(size, Path(tmp))
            runs = [bench(path, size, eos) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"vocab {size}: " + "  ".join(f"{k}={v:.1f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
