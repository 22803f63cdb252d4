"""Our fused MoE (chip_child.models.moe_triton) against the torch reference, on the cpu under Triton's
interpreter: the sorted, padded layout, and the layer's output over several shapes."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # on cuda the kernels compile; these tests then skip
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
pytest.importorskip("triton")

from chip_child.config import RuntimeConfig  # noqa: E402
from chip_child.local import LocalDriver, LocalRequest  # noqa: E402
from chip_child.models.moe import MoeWeights, torch_moe  # noqa: E402
from chip_child.step.runtime import ChipRuntime  # noqa: E402
from chip_child.models.moe_triton import align_by_expert, triton_moe  # noqa: E402

from test_moe import split_experts  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_layout_groups_pairs_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])  # expert 1 gets nothing
    sorted_pairs, block_expert = align_by_expert(ids, 4, block_m=4)
    sentinel = ids.numel()
    assert sorted_pairs.numel() == 8 + 4 * 3 and block_expert.numel() == 5
    runs = {0: [1, 4], 2: [0, 2, 5, 7], 3: [3, 6]}  # pair ids (token * 2 + j) per expert, ascending
    assert block_expert.tolist() == [0, 2, 3, 4, 4]  # past the used blocks: the sentinel expert
    assert sorted_pairs[:12].tolist() == [1, 4, sentinel, sentinel, 0, 2, 5, 7, 3, 6, sentinel, sentinel]
    assert all(ids.flatten()[p].item() == e for e, ps in runs.items() for p in ps)
    assert (sorted_pairs[12:] == sentinel).all()


def weights(num_experts: int, hidden: int, inter: int, top_k: int, norm: bool, dtype: torch.dtype) -> MoeWeights:
    g = torch.Generator().manual_seed(num_experts + hidden)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(dtype)  # noqa: E731
    return MoeWeights(router=r(hidden, num_experts) * 5, gate_up=r(num_experts, hidden, 2 * inter),
                      down=r(num_experts, inter, hidden), top_k=top_k, norm_topk_prob=norm)


@pytest.mark.parametrize("tokens, experts, hidden, inter, top_k, norm", [
    (1, 4, 32, 48, 2, True), (7, 8, 64, 40, 3, False), (40, 6, 48, 64, 2, True), (0, 4, 32, 32, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_moe_matches_the_reference(tokens: int, experts: int, hidden: int, inter: int, top_k: int,
                                          norm: bool, dtype: torch.dtype) -> None:
    w = weights(experts, hidden, inter, top_k, norm, dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    want = torch_moe(x, w)
    got = triton_moe(x, w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif tokens:
        # bf16: the interpreter truncates fp32 -> bf16 where torch rounds to nearest (a store of
        # randn differs in half the values), so each of the kernel's roundings may cost 2^-8 more;
        # measured here: 2% of the largest output against fp32 math, the reference 0.6%.
        rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert rel <= 2 ** -5, f"relative error {rel:.2e}: more than a few bf16 rounding steps"


@pytest.mark.parametrize("world", [2, 4])
def test_triton_moe_expert_parallel_parts_sum_to_the_layer(world: int) -> None:
    """Each expert-parallel rank runs only its experts' pairs (the others' rows stay zero): the
    ranks' outputs sum to the whole layer's, as the all-reduce sums them."""
    w = weights(8, 32, 48, 3, True, torch.float32)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(3))
    parts = split_experts(w, world)
    got = [triton_moe(x, part) for part in parts]
    for part, out in zip(parts, got):
        torch.testing.assert_close(out, torch_moe(x, part), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(got).sum(0), torch_moe(x, w), rtol=1e-5, atol=1e-5)


def test_runtime_with_fused_kernels_runs_the_fused_moe(make_checkpoint) -> None:
    """A Qwen3-MoE runtime with fused_kernels=True (the cuda ops, here interpreted): the torch
    runtime's tokens, fp32 logits within 1e-5."""
    path = make_checkpoint("moe-fused", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    results = {}
    for setting in (False, True):
        rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=3, max_seq_len=64,
                                       page_size=8, fused_kernels=setting, decode_graphs=False))
        assert rt.ops.moe is (triton_moe if setting else torch_moe)
        if setting:  # the fused MoE passed its start-up self-check
            assert ("moe", True) in [(v.kernel, v.used) for v in rt.kernel_checks]
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 9, 20)]
        results[setting] = LocalDriver(rt).run([LocalRequest(p, 8) for p in prompts], keep_logits=True)
    assert results[True].token_ids == results[False].token_ids
    for mine, want in zip(results[True].logits, results[False].logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(want), rtol=1e-5, atol=1e-5)


def test_a_fused_moe_that_fails_its_self_check_falls_back_to_the_reference(make_checkpoint, monkeypatch,
                                                                           capsys) -> None:
    path = make_checkpoint("moe-fused", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    from chip_child.models import fused as fused_module

    real = fused_module.triton_layer_ops()
    wrong = dataclasses.replace(real, moe=lambda x, w: triton_moe(x, w).flip(0))  # rows swapped: injected error
    monkeypatch.setattr("chip_child.step.runtime.triton_layer_ops", lambda: wrong)
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=3, max_seq_len=64,
                                   page_size=8, fused_kernels=True, decode_graphs=False))
    assert rt.ops.moe is torch_moe
    assert [(v.kernel, v.used) for v in rt.kernel_checks if v.kernel == "moe"] == [("moe", False)]
    assert "kernel moe failed its self-check" in capsys.readouterr().err
