"""Llama (3.x rope scaling), Qwen2 / Qwen2.5 (q/k/v biases, no q/k norm) and Mistral as
configuration of the one model: config parsing, the tensors expected, and greedy tokens and fp32
logits against transformers, in process, prepacked, and tensor parallel over two cpu children."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chip_child.models import prepack
from chip_child.config import RuntimeConfig
from chip_child.models.loader import expected_tensor_shapes, load_config
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.rope import inv_freq
from chip_child.step.runtime import ChipRuntime
from l3worker import DistributedWorker, SamplingParams

from parity import assert_matches_transformers  # noqa: E402
from model_files import write_config

NEW_TOKENS = 24
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # scaled, smoothed and kept bands

# name, family, config overrides
CHECKPOINTS = {
    "llama3-gqa2": ("llama", dict(rope_parameters=LLAMA3)),
    "llama-bias-tied-mha": ("llama", dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=4,
                                          rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})),
    "qwen2-default-hd": ("qwen2", dict(head_dim=..., hidden_size=96, num_attention_heads=6, num_key_value_heads=2)),
    "qwen2-gqa4-tied": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, num_hidden_layers=3)),
    "mistral": ("mistral", dict(sliding_window=256)),
}


def checkpoint(make_checkpoint, name: str) -> Path:
    family, overrides = CHECKPOINTS[name]
    return make_checkpoint(name, family=family, **overrides)


def prompts(vocab: int, lens: tuple[int, ...] = (1, 5, 13, 40), seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


# -- config ---------------------------------------------------------------------------------------

def test_config_of_each_family(make_checkpoint) -> None:
    llama = load_config(checkpoint(make_checkpoint, "llama3-gqa2"))
    assert (llama.architecture, llama.qk_norm, llama.qkv_bias, llama.o_bias) == ("LlamaForCausalLM", False, False, False)
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert llama.rope_scaling.original_max_position_embeddings == 64
    biased = load_config(checkpoint(make_checkpoint, "llama-bias-tied-mha"))
    assert biased.qkv_bias and biased.o_bias and biased.rope_scaling.rope_type == "linear"
    qwen2 = load_config(checkpoint(make_checkpoint, "qwen2-default-hd"))
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_bias, qwen2.head_dim) == (False, True, False, 16)
    mistral = load_config(checkpoint(make_checkpoint, "mistral"))
    assert (mistral.architecture, mistral.qkv_bias, mistral.qk_norm) == ("MistralForCausalLM", False, False)
    assert mistral.max_position_embeddings == 256  # capped at the sliding window: within it, full attention


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_expected_tensors_match_transformers(make_checkpoint, hf_model, name: str) -> None:
    path = checkpoint(make_checkpoint, name)
    hf = {k: tuple(v.shape) for k, v in hf_model(path).state_dict().items()}
    if load_config(path).tie_word_embeddings:
        del hf["lm_head.weight"]
    assert expected_tensor_shapes(load_config(path)) == hf


@pytest.mark.parametrize("params", [LLAMA3, {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
                                    {"rope_type": "default", "rope_theta": 1e6}], ids=["llama3", "linear", "default"])
def test_inv_freq_matches_transformers(tmp_path: Path, params: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    if params["rope_type"] == "default":
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    raw = {"architectures": ["LlamaForCausalLM"], "rope_parameters": params}
    cfg = load_config(write_config(tmp_path, **raw, hidden_size=256, num_attention_heads=2, num_key_value_heads=2))
    assert cfg.head_dim == 128
    torch.testing.assert_close(inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling), want, rtol=0, atol=0)


def test_config_refusals_of_the_families(tmp_path: Path) -> None:
    write_config(tmp_path, architectures=["LlamaForCausalLM"], mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        load_config(tmp_path)
    write_config(tmp_path, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_config(tmp_path)


# -- parity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_tokens_and_logits_match_transformers(make_checkpoint, hf_model, name: str) -> None:
    path = checkpoint(make_checkpoint, name)
    model = hf_model(path)
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=4, max_seq_len=80,
                                   page_size=4))
    ps = prompts(model.config.vocab_size)
    res = LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in ps], keep_logits=True)
    assert_matches_transformers(model, ps, res.token_ids, res.logits, NEW_TOKENS)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("name", ["qwen2-gqa4-tied", "llama-bias-tied-mha"])
def test_prepacked_with_biases_matches_transformers(make_checkpoint, hf_model, monkeypatch, name: str) -> None:
    """Every projection prepacked: the biases go through oneDNN's op."""
    monkeypatch.setattr(prepack, "MIN_PACKED_ELEMENTS", 0)
    path = checkpoint(make_checkpoint, name)
    model = hf_model(path)
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=4, max_seq_len=80,
                                   page_size=4, cpu_prepack=True))
    assert isinstance(rt.weights.layers[0].qkv, prepack.PackedLinear) and rt.weights.layers[0].qkv_bias is not None
    ps = prompts(model.config.vocab_size, seed=9)
    res = LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in ps], keep_logits=True)
    assert_matches_transformers(model, ps, res.token_ids, res.logits, NEW_TOKENS)


@pytest.mark.parametrize("name", ["llama3-gqa2", "qwen2-gqa4-tied", "mistral"])
def test_tensor_parallel_two_children_match_transformers(make_checkpoint, hf_model, name: str) -> None:
    path = checkpoint(make_checkpoint, name)
    model = hf_model(path)
    ps = prompts(model.config.vocab_size, (5, 3, 25), seed=11)
    ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
           for p in ps]
    with DistributedWorker(str(path), device="cpu", device_ids=(0, 1), max_batch_size=4, max_seq_len=128,
                           page_size=8) as w:
        assert len(set(w.child_pids)) == 2
        outs = w.generate(ps, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == ref
