"""Tests for chip_child.models.loader and chip_child.models.tiny_model (CPU only, no downloads)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from model_files import write_config
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from chip_child.models.loader import (
    ModelConfig,
    expected_tensor_shapes,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_dtype,
)
from chip_child.models.tiny_model import TINY_MODEL_NAME, ensure_tiny_model, tiny_model_config, write_tiny_model

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=16,  # != hidden_size / num_heads (8)
    max_position_embeddings=128,
)


def save_hf(path: Path, **overrides: Any) -> Qwen3ForCausalLM:
    """Save a random tiny HF Qwen3 checkpoint and return the model."""
    torch.manual_seed(0)
    kwargs = {**SMALL, **overrides}
    shard = kwargs.pop("max_shard_size", None)
    model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def sha256_files(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("tied", [True, False])
def test_config_from_saved_hf_checkpoint(tmp_path: Path, tied: bool) -> None:
    save_hf(tmp_path, tie_word_embeddings=tied, rope_theta=5e5, eos_token_id=[3, 5])
    cfg = load_config(tmp_path)
    assert cfg == ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=5e5,
        tie_word_embeddings=tied,
        qkv_bias=False,
        o_bias=False,
        max_position_embeddings=128,
        torch_dtype="float32",
        eos_token_ids=(3, 5),
    )


def test_config_old_style_defaults(tmp_path: Path) -> None:
    write_config(tmp_path, num_key_value_heads=..., torch_dtype=..., attention_bias=...)
    cfg = load_config(tmp_path)
    assert cfg.num_kv_heads == cfg.num_heads == 8
    assert cfg.head_dim == 128  # what transformers' Qwen3Config assumes when head_dim is absent
    assert cfg.rope_theta == 1e6
    assert cfg.torch_dtype == "float32"
    assert cfg.qkv_bias is False and cfg.o_bias is False
    assert cfg.eos_token_ids == (7,)


def test_config_rope_parameters_and_dtype_keys(tmp_path: Path) -> None:
    write_config(
        tmp_path,
        rope_theta=...,
        rope_scaling=...,
        rope_parameters={"rope_type": "default", "rope_theta": 123.0},
        torch_dtype=...,
        dtype="float16",
    )
    cfg = load_config(tmp_path)
    assert cfg.rope_theta == 123.0
    assert cfg.torch_dtype == "float16"


def test_config_eos_union_with_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, eos_token_id=[7, 8])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9, 7, 10]}))
    assert load_config(tmp_path).eos_token_ids == (7, 8, 9, 10)


def test_config_eos_only_in_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, eos_token_id=None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert load_config(tmp_path).eos_token_ids == (11,)


def test_config_model_type_without_architectures(tmp_path: Path) -> None:
    write_config(tmp_path, architectures=...)
    assert load_config(tmp_path).num_layers == 2


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*supported: Qwen3ForCausalLM"),
        ({"architectures": ..., "model_type": "gemma"}, "gemma.*supported: Qwen3ForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "longrope"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0}}, "linear.*factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, r"8.*3"),
        ({"dtype": "float64"}, "float64"),
    ],
)
def test_config_rejects(tmp_path: Path, overrides: dict[str, Any], match: str) -> None:
    write_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        load_config(tmp_path)


def test_config_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_config(tmp_path / "nope")


# ---------------------------------------------------------------- shapes / weights


@pytest.mark.parametrize("tied, bias", [(True, False), (False, False), (False, True)])
def test_expected_shapes_match_transformers(tmp_path: Path, tied: bool, bias: bool) -> None:
    model = save_hf(tmp_path, tie_word_embeddings=tied, attention_bias=bias)
    cfg = load_config(tmp_path)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:  # the tied head is in state_dict() but not in the saved file
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        del hf["lm_head.weight"]
    assert expected_tensor_shapes(cfg) == hf


@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("tied", [True, False])
def test_load_weights_equals_hf_state_dict(tmp_path: Path, shard: str | None, tied: bool) -> None:
    model = save_hf(tmp_path, tie_word_embeddings=tied, max_shard_size=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    cfg = load_config(tmp_path)
    weights = load_weights(tmp_path, cfg, torch.float32)
    assert list(weights) == list(expected_tensor_shapes(cfg))
    state = model.state_dict()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_load_weights_casts_dtype(tmp_path: Path) -> None:
    save_hf(tmp_path)
    weights = load_weights(tmp_path, load_config(tmp_path), torch.bfloat16)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_load_weights_ignores_extra_lm_head_when_tied(tmp_path: Path) -> None:
    save_hf(tmp_path, tie_word_embeddings=True)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    assert "lm_head.weight" not in load_weights(tmp_path, load_config(tmp_path), torch.float32)


def test_load_weights_missing_tensor(tmp_path: Path) -> None:
    save_hf(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        load_weights(tmp_path, load_config(tmp_path), torch.float32)


def test_load_weights_missing_from_index(tmp_path: Path) -> None:
    save_hf(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*index\.json"):
        load_weights(tmp_path, load_config(tmp_path), torch.float32)


def test_load_weights_wrong_shape(tmp_path: Path) -> None:
    save_hf(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\[16, 32\].*\[32, 32\]"):
        load_weights(tmp_path, load_config(tmp_path), torch.float32)


def test_load_weights_missing_files(tmp_path: Path) -> None:
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_weights(tmp_path, load_config(tmp_path), torch.float32)


# ---------------------------------------------------------------- dtype / tokenizer


def test_resolve_dtype(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path))  # checkpoint dtype bfloat16
    assert resolve_dtype("auto", "cpu", cfg) == torch.float32
    assert resolve_dtype("auto", "cuda", cfg) == torch.bfloat16
    assert resolve_dtype("auto", "npu", cfg) == torch.bfloat16
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16), ("half", torch.float16),
                        ("float16", torch.float16), ("BFloat16", torch.bfloat16)]:
        assert resolve_dtype(name, "cpu", cfg) == dtype
    with pytest.raises(ValueError, match="dtype.*bf16"):
        resolve_dtype("int8", "cpu", cfg)


def test_load_tokenizer_absent(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None


# ---------------------------------------------------------------- tiny model


def test_tiny_model_byte_identical(tmp_path: Path) -> None:
    a, b = write_tiny_model(tmp_path / "a"), write_tiny_model(tmp_path / "b")
    hashes = sha256_files(a)
    assert set(hashes) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer_config.json"}
    assert hashes == sha256_files(b)


def test_tiny_model_loads_everywhere(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path)
    cfg = load_config(path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (320, 64, 32, 4, 2)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (256,) and cfg.rope_theta == 1e6
    weights = load_weights(path, cfg, torch.float32)

    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    assert model.config.head_dim == 32
    state = model.state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)

    # Greedy decode must not collapse onto one repeated token.
    prompt = list(b"hello")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=256)
    new = out[0, len(prompt):].tolist()
    assert len(set(new)) >= 8, new
    assert all(t <= 256 for t in new)  # padding ids are never chosen


def test_tiny_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = load_tokenizer(write_tiny_model(tmp_path))
    assert tok is not None
    assert tok.encode("hello").ids == list(b"hello")
    assert tok.get_vocab_size() == 261  # bytes, <|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>
    text = "Grüße, 世界! 🙂\n\ttabs  and\x00bytes"
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode("a<|endoftext|>").ids == [97, 256]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [257, *b"user\nhi", 258]
    assert tok.decode([257, 104, 258, 259]) == "h<think>"  # chat framing tokens are special, <think> is not


def test_tiny_config_dict() -> None:
    raw = tiny_model_config()
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["head_dim"] == 32


def test_ensure_tiny_model_caches(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path)
    assert path == tmp_path / TINY_MODEL_NAME
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert ensure_tiny_model(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    assert [p.name for p in tmp_path.iterdir()] == [TINY_MODEL_NAME]  # no temp dirs left


def test_ensure_tiny_model_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("L3WORKER_CACHE", str(tmp_path / "cache"))
    path = ensure_tiny_model()
    assert path == tmp_path / "cache" / TINY_MODEL_NAME
    assert sha256_files(path) == sha256_files(write_tiny_model(tmp_path / "ref"))


def test_ensure_tiny_model_repairs_incomplete(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path)
    (path / "model.safetensors").unlink()
    assert ensure_tiny_model(tmp_path) == path
    assert (path / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [TINY_MODEL_NAME]


def test_ensure_tiny_model_concurrent(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / TINY_MODEL_NAME] * 6
    assert os.listdir(tmp_path) == [TINY_MODEL_NAME]
    load_weights(results[0], load_config(results[0]), torch.float32)
