"""Qwen3-MoE (Qwen3MoeForCausalLM): routing and experts against transformers, in process and
tensor parallel over two cpu children. Router ties are avoided by construction: the router
weights are redrawn large after transformers writes the checkpoint, and each test checks that
transformers' own top-k choices had a margin far above fp32 rounding."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chip_child.config import RuntimeConfig
from chip_child.models.loader import expected_tensor_shapes, load_config
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.qwen3 import shard_config
from chip_child.models.moe import MoeWeights, parse_moe, route, torch_moe
from chip_child.step.runtime import ChipRuntime
from l3worker import DistributedWorker, SamplingParams

from checkpoints import write_hf_checkpoint  # noqa: E402
from parity import assert_matches_transformers  # noqa: E402

NEW_TOKENS = 20
MIN_ROUTER_MARGIN = 1e-4  # k-th vs (k+1)-th router logit (~1 to 10); ours and transformers' differ by ~1e-6
CHECKPOINTS = {
    # top-2 of 4, renormalised, layer 1 dense
    "moe-norm": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     mlp_only_layers=[1], num_hidden_layers=3),
    # top-3 of 8, not renormalised, every second layer sparse, tied, GQA 4
    "moe-step2": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False,
                      decoder_sparse_step=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            path = write_hf_checkpoint(tmp_path_factory.mktemp(name), 0, "qwen3_moe", **CHECKPOINTS[name])
            tensors = load_file(path / "model.safetensors")
            g = torch.Generator().manual_seed(1)
            for key in tensors:
                if key.endswith("mlp.gate.weight"):  # spread the router's logits: no near-ties
                    tensors[key] = torch.randn(tensors[key].shape, generator=g) * 0.5
            save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
            made[name] = path
        return made[name]

    return make


def prompts(vocab: int, lens=(1, 6, 17, 40), seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def assert_router_margins(model, sequences: list[list[int]]) -> None:
    """transformers' own routing of these tokens is far from any tie."""
    k = model.config.num_experts_per_tok
    for seq in sequences:
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_router_logits=True)
        for logits in out.router_logits:
            top = logits.float().topk(k + 1, -1).values  # the softmax keeps the logits' order
            assert (top[:, k - 1] - top[:, k]).min().item() > MIN_ROUTER_MARGIN


# -- config ---------------------------------------------------------------------------------------

def test_sparse_layers_follow_mlp_only_layers_and_the_step() -> None:
    raw = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
    assert parse_moe(raw, 4, Path("c")).sparse_layers == (0, 1, 2, 3)
    assert parse_moe({**raw, "mlp_only_layers": [0, 2]}, 4, Path("c")).sparse_layers == (1, 3)
    assert parse_moe({**raw, "decoder_sparse_step": 2}, 6, Path("c")).sparse_layers == (1, 3, 5)
    renamed = {k: v for k, v in raw.items() if k != "num_experts"}  # transformers 5 saves num_local_experts
    assert parse_moe({**renamed, "num_local_experts": 16}, 1, Path("c")).num_experts == 16
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_moe({**raw, "num_experts_per_tok": 129}, 1, Path("c"))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_config_and_tensors_match_transformers(moe_checkpoint, hf_model, name: str) -> None:
    path = moe_checkpoint(name)
    cfg = load_config(path)
    want = CHECKPOINTS[name]
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.norm_topk_prob) == (
        want["num_experts"], want["num_experts_per_tok"], want["moe_intermediate_size"], want["norm_topk_prob"])
    hf = {k: tuple(v.shape) for k, v in hf_model(path).state_dict().items()}
    hf.pop("lm_head.weight") if cfg.tie_word_embeddings else None
    # transformers keeps each layer's experts fused in memory; the checkpoint has them per expert.
    saved = {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}
    saved.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    assert expected_tensor_shapes(cfg) == saved
    assert {k for k in hf if ".experts." not in k} == {k for k in saved if ".experts." not in k}


def test_shard_config_divides_each_experts_intermediate(moe_checkpoint) -> None:
    cfg = load_config(moe_checkpoint("moe-norm"))
    assert shard_config(cfg, 2).moe.intermediate_size == 16
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        shard_config(replace(cfg, moe=replace(cfg.moe, intermediate_size=33)), 2)


def test_expert_parallel_config_and_refusals(moe_checkpoint, make_checkpoint) -> None:
    cfg = load_config(moe_checkpoint("moe-norm"))
    assert shard_config(cfg, 2, expert_parallel=True).moe == cfg.moe  # experts whole, the full router
    with pytest.raises(ValueError, match="num_experts=5 .*enable_expert_parallel"):
        shard_config(replace(cfg, moe=replace(cfg.moe, num_experts=5)), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="needs more than one device in device_ids, got 1"):
        DistributedWorker(str(moe_checkpoint("moe-norm")), device="cpu", max_seq_len=128, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no experts"):
        DistributedWorker(str(make_checkpoint()), device="cpu", device_ids=(0, 1), max_seq_len=128,
                          enable_expert_parallel=True)


# -- the layer ------------------------------------------------------------------------------------

def split_experts(w: MoeWeights, world: int) -> list[MoeWeights]:
    """Each expert-parallel rank's weights: num_experts / world experts whole, the full router."""
    n = w.gate_up.shape[0] // world
    return [replace(w, gate_up=w.gate_up[r * n:(r + 1) * n], down=w.down[r * n:(r + 1) * n], first_expert=r * n)
            for r in range(world)]

@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_torch_moe_matches_transformers_block(tokens: int, norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(tokens)
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                         norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    experts = block.experts
    w = MoeWeights(router=block.gate.weight.detach().t(), gate_up=experts.gate_up_proj.detach().transpose(1, 2),
                   down=experts.down_proj.detach().transpose(1, 2), top_k=2, norm_topk_prob=norm)
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        want = block(x[None])[0]
    weights, ids = route(x, w)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    torch.testing.assert_close(torch_moe(x, w), want, rtol=1e-5, atol=1e-5)
    for world in (2, 3, 6):  # expert parallel: the ranks' outputs sum to the layer's (the all-reduce)
        parts = [torch_moe(x, part) for part in split_experts(w, world)]
        assert all(part.is_partial for part in split_experts(w, world))
        torch.testing.assert_close(torch.stack(parts).sum(0), want, rtol=1e-5, atol=1e-5)


# -- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_tokens_and_logits_match_transformers(moe_checkpoint, hf_model, name: str) -> None:
    path = moe_checkpoint(name)
    model = hf_model(path)
    ps = prompts(model.config.vocab_size)
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=4, max_seq_len=80,
                                   page_size=4))
    res = LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in ps], keep_logits=True)
    assert_router_margins(model, [p + t for p, t in zip(ps, res.token_ids)])
    assert_matches_transformers(model, ps, res.token_ids, res.logits, NEW_TOKENS)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tensor_parallel_two_children_match_transformers(moe_checkpoint, hf_model, expert_parallel: bool) -> None:
    """Each expert's intermediate dimension split over two ranks, or (expert parallel) four of
    the eight experts whole on each: the same tokens as transformers either way."""
    path = moe_checkpoint("moe-step2")
    model = hf_model(path)
    ps = prompts(model.config.vocab_size, (5, 3, 25), seed=2)
    ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
           for p in ps]
    assert_router_margins(model, [p + r for p, r in zip(ps, ref)])
    with DistributedWorker(str(path), device="cpu", device_ids=(0, 1), max_batch_size=4, max_seq_len=128,
                           page_size=8, enable_expert_parallel=expert_parallel) as w:
        outs = w.generate(ps, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
        assert w.stats()["moe_experts"] == ([0, 4] if expert_parallel else [0, 8])  # rank 0's experts
    assert [o.token_ids for o in outs] == ref
