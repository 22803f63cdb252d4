"""Block FP8 checkpoints (the Qwen3-*-FP8 format): written here from random plain checkpoints by
quantizing each projection per block, loaded dequantized; the tokens and logits equal those of the
same model stored dequantized, which transformers runs as the reference."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chip_child.config import RuntimeConfig
from chip_child.models.fp8 import FP8, dequantize_blocks, quantize_blocks
from chip_child.models.loader import load_config, load_weights
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.quant import BlockFp8
from chip_child.step.runtime import ChipRuntime
from l3worker import DistributedWorker, SamplingParams

from parity import assert_matches_transformers  # noqa: E402
from model_files import write_config

NEW_TOKENS = 16
QWEN3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def is_projection(name: str) -> bool:
    return name.endswith("_proj.weight")  # attention and MLP (and expert) projections, as the releases quantize


def write_fp8_pair(src: Path, out: Path, block: tuple[int, int], sharded: bool = False) -> tuple[Path, Path]:
    """(fp8 checkpoint, the same weights dequantized to fp32) from the plain checkpoint `src`.
    Sharded: the scales go to a second file, so the loader must find them through the index."""
    fp8_dir, deq_dir = out / "fp8", out / "dequantized"
    tensors = load_file(src / "model.safetensors")
    weights, scales, deq = {}, {}, {}
    for name, t in tensors.items():
        if is_projection(name):
            q, s = quantize_blocks(t, block)
            weights[name], scales[name + "_scale_inv"] = q, s
            deq[name] = dequantize_blocks(q, s, block, torch.float32)
        else:
            weights[name] = deq[name] = t
    raw = json.loads((src / "config.json").read_text())
    for d in (fp8_dir, deq_dir):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(raw))
    save_file(deq, deq_dir / "model.safetensors", metadata={"format": "pt"})
    raw["quantization_config"] = {**QWEN3_FP8, "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(raw))
    if sharded:
        save_file(weights, fp8_dir / "weights.safetensors", metadata={"format": "pt"})
        save_file(scales, fp8_dir / "scales.safetensors", metadata={"format": "pt"})
        weight_map = {**{n: "weights.safetensors" for n in weights}, **{n: "scales.safetensors" for n in scales}}
        (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({**weights, **scales}, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    return fp8_dir, deq_dir


# -- format ----------------------------------------------------------------------------------------

def test_config_declares_block_fp8(tmp_path: Path) -> None:
    write_config(tmp_path, quantization_config=QWEN3_FP8)
    assert load_config(tmp_path).quantization == BlockFp8(block=(128, 128))


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    ({**QWEN3_FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**QWEN3_FP8, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({**QWEN3_FP8, "weight_block_size": [128]}, "weight_block_size"),
])
def test_config_refuses_other_fp8_variants(tmp_path: Path, qc: dict, match: str) -> None:
    write_config(tmp_path, quantization_config=qc)
    with pytest.raises(ValueError, match=match):
        load_config(tmp_path)


@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((100, 70), (32, 48)), ((5, 7), (128, 128))])
def test_dequantize_is_the_per_block_product(shape: tuple[int, int], block: tuple[int, int]) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, s = quantize_blocks(w, block)
    assert q.dtype == FP8 and s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    got = dequantize_blocks(q, s, block, torch.float32)
    want = torch.empty(shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            want[rows, cols] = q[rows, cols].float() * s[i, j]
    assert torch.equal(got, want)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of its magnitude (plus the block's floor)
    assert ((got - w).abs() <= w.abs() / 16 + s.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(
        block[1], 1)[:, :shape[1]] * 2 ** -9).all()
    assert torch.equal(dequantize_blocks(q, s, block, torch.bfloat16), want.to(torch.bfloat16))


def test_missing_scale_is_refused(make_checkpoint, tmp_path: Path) -> None:
    fp8_dir, _ = write_fp8_pair(make_checkpoint(), tmp_path, (128, 128))
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj\.weight.*weight_scale_inv"):
        load_weights(fp8_dir, load_config(fp8_dir), torch.float32)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_loaded_weights_equal_the_dequantized_checkpoint(make_checkpoint, tmp_path: Path, sharded: bool) -> None:
    fp8_dir, deq_dir = write_fp8_pair(make_checkpoint(), tmp_path, (32, 48), sharded)
    for dtype in (torch.float32, torch.bfloat16):
        got = load_weights(fp8_dir, load_config(fp8_dir), dtype)
        want = load_weights(deq_dir, load_config(deq_dir), dtype)
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


# -- the model ---------------------------------------------------------------------------------------

def run(path: Path, prompts: list[list[int]]):
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=4, max_seq_len=80,
                                   page_size=4))
    return LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in prompts], keep_logits=True)


@pytest.mark.parametrize("name, family, overrides, block", [
    ("default", "qwen3", {}, (128, 128)),
    ("fp8-llama", "llama", dict(attention_bias=True, num_key_value_heads=1), (32, 48)),
])
def test_fp8_model_equals_the_dequantized_model(make_checkpoint, hf_model, tmp_path: Path, name: str, family: str,
                                                overrides: dict, block: tuple[int, int]) -> None:
    fp8_dir, deq_dir = write_fp8_pair(make_checkpoint(name, family=family, **overrides), tmp_path, block)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
    got, want = run(fp8_dir, prompts), run(deq_dir, prompts)
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logits, want.logits):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert_matches_transformers(hf_model(deq_dir), prompts, got.token_ids, got.logits, NEW_TOKENS)


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of `prompts`."""
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def test_fp8_tensor_parallel_two_children(make_checkpoint, hf_model, tmp_path: Path) -> None:
    fp8_dir, deq_dir = write_fp8_pair(make_checkpoint(), tmp_path, (32, 32), sharded=True)
    prompts = [[1, 2, 3, 4, 5], list(range(20, 45))]
    ref = greedy(hf_model(deq_dir), prompts)
    with DistributedWorker(str(fp8_dir), device="cpu", device_ids=(0, 1), max_batch_size=4, max_seq_len=128,
                           page_size=8) as w:
        outs = w.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == ref


def test_fp8_moe_experts_equal_the_dequantized_model(make_checkpoint, tmp_path: Path) -> None:
    """Qwen3-MoE FP8: every expert's projections quantized (the router stays plain, as released)."""
    src = make_checkpoint("fp8-moe", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True)
    fp8_dir, deq_dir = write_fp8_pair(src, tmp_path, (16, 32))
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in load_file(fp8_dir / "model.safetensors")
    prompts = [[1, 2, 3, 4, 5], list(range(20, 60))]
    got, want = run(fp8_dir, prompts), run(deq_dir, prompts)
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logits, want.logits):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- quantization="fp8": a plain checkpoint quantized at load ----------------------------------------

AT_LOAD_SHAPE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64)  # several 128 x 128 blocks per projection, ragged ones in k/v


def bf16_copy(src: Path, out: Path) -> Path:
    """`src` stored in bfloat16, as most released checkpoints are."""
    out.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw["torch_dtype"] = raw["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw))
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_quantization_fp8_loads_the_weights_its_fp8_checkpoint_holds(make_checkpoint, tmp_path: Path,
                                                                      stored: str) -> None:
    src = make_checkpoint("fp8-at-load", **AT_LOAD_SHAPE)
    if stored == "bfloat16":
        src = bf16_copy(src, tmp_path / "bf16")
    cfg = load_config(src, "fp8")
    assert cfg.quantization == BlockFp8(block=(128, 128), at_load=True)
    fp8_dir, deq_dir = write_fp8_pair(src, tmp_path / "pair", (128, 128))
    for dtype in (torch.float32, torch.bfloat16):
        got = load_weights(src, cfg, dtype)
        assert list(got) == list(load_weights(fp8_dir, load_config(fp8_dir), dtype))
        for name, want in load_weights(fp8_dir, load_config(fp8_dir), dtype).items():
            assert torch.equal(got[name], want), name
    plain = load_weights(src, load_config(src), torch.float32)
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(got[down].float(), plain[down].bfloat16().float())  # quantized: coarser than bf16
    assert torch.equal(got["model.embed_tokens.weight"].float(), plain["model.embed_tokens.weight"].bfloat16().float())


def test_quantization_fp8_worker_matches_transformers_on_the_round_tripped_weights(make_checkpoint, hf_model,
                                                                                    tmp_path: Path) -> None:
    """Through DistributedWorker (the argument reaches the child): greedy tokens equal transformers'
    on the same weights quantized and dequantized per 128 x 128 block, in fp32."""
    src = bf16_copy(make_checkpoint("fp8-at-load", **AT_LOAD_SHAPE), tmp_path / "bf16")
    _, deq_dir = write_fp8_pair(src, tmp_path / "pair", (128, 128))
    prompts = [[1, 2, 3, 4, 5], list(range(20, 45))]
    ref = greedy(hf_model(deq_dir), prompts)
    assert greedy(hf_model(src), prompts) != ref  # quantizing changes the tokens: a plain load would fail
    with DistributedWorker(str(src), device="cpu", dtype="float32", quantization="fp8", max_batch_size=4,
                           max_seq_len=128, page_size=8) as w:
        outs = w.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == ref


def test_quantization_argument_refusals(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint()
    for method in ("awq", "gptq", "bitsandbytes", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"unsupported quantization '{method}'; supported: fp8"):
            DistributedWorker(str(src), device="cpu", quantization=method)
    with pytest.raises(TypeError, match="quantization must be a method name"):
        load_config(src, True)
    fp8_dir, _ = write_fp8_pair(src, tmp_path, (128, 128))
    assert load_config(fp8_dir, "fp8").quantization == load_config(fp8_dir).quantization == BlockFp8((128, 128))
    with pytest.raises(ValueError, match="quantization='awq' contradicts .*quant_method is 'fp8'"):
        DistributedWorker(str(fp8_dir), device="cpu", quantization="awq")
