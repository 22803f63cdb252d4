"""The npu MoE (chip_child.models.moe_npu) on the cpu against a stand-in torch_npu whose MoE ops follow
their documented semantics (tests/npu_moe_reference.py): the stand-in ops against the documents'
own examples and formulas, then the layer against the torch reference, expert parallel included,
and a whole model's tokens."""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.moe import MoeWeights, torch_moe
from chip_child.models.moe_npu import npu_moe
from chip_child.step.runtime import ChipRuntime

import npu_moe_reference as ref  # noqa: E402
from npu_reference import fake_torch_npu  # noqa: E402
from test_moe import split_experts  # noqa: E402


@pytest.fixture
def npu(monkeypatch):
    mod = fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


# -- the stand-in ops, against their documents -------------------------------------------------------

def test_gating_top_k_softmax_row_idx_and_finished() -> None:
    x = torch.tensor([[0.1, 2.0, 1.0, -1.0], [3.0, 0.0, 0.5, 0.2], [0.0, 0.0, 0.1, 0.3]])
    y, idx, row_idx = ref.npu_moe_gating_top_k_softmax(x, None, k=2)
    want_y, want_idx = torch.softmax(x, -1).topk(2, -1)
    assert torch.equal(y, want_y) and torch.equal(idx, want_idx.int()) and idx.dtype == torch.int32
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]  # arange(N * k).reshape(k, N).T
    _, idx, _ = ref.npu_moe_gating_top_k_softmax(x, torch.tensor([False, True, False]), k=2)
    assert idx[1].tolist() == [4, 4] and idx[0].tolist() == want_idx[0].tolist()
    with pytest.raises(RuntimeError, match="k must be"):
        ref.npu_moe_gating_top_k_softmax(x, None, k=5)


def test_init_routing_matches_the_documented_example() -> None:
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = ref.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    # stable sort of [1, 2, 0, 1, 0, 2]: pairs 2, 4 (expert 0), 0, 3 (1), 1, 5 (2); their row ids 1, 2, 0, 4, 3, 5
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    assert torch.equal(expanded_x, x[[1, 2, 0, 1, 0, 2]])
    assert ref.npu_moe_init_routing(x, row_idx, expert_idx, 1)[0].shape == (2, 4)  # min(active_num, N) * K rows
    with pytest.raises(RuntimeError, match="int32"):
        ref.npu_moe_init_routing(x, row_idx.long(), expert_idx, 3)


def test_grouped_matmul_groups_rows_over_m_and_checks_group_list() -> None:
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(7, 5, generator=g), torch.randn(3, 5, 4, generator=g)
    ends = torch.tensor([2, 2, 7])  # expert 1 gets no rows
    (y,) = ref.npu_grouped_matmul([a], [w], group_list=ends, group_type=0, group_list_type=0, split_item=2)
    torch.testing.assert_close(y, torch.cat([a[:2] @ w[0], a[2:] @ w[2]]))
    (counts,) = ref.npu_grouped_matmul([a], [w], group_list=torch.tensor([2, 0, 5]), group_type=0,
                                       group_list_type=1, split_item=3)
    assert torch.equal(counts, y)
    for bad in (torch.tensor([2, 1, 7]), torch.tensor([2, 2, 6]), torch.tensor([2, 7], dtype=torch.int64),
                torch.tensor([2, 2, 7], dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="group_list"):
            ref.npu_grouped_matmul([a], [w], group_list=bad, group_type=0, group_list_type=0, split_item=2)


def test_finalize_routing_is_the_documented_sum() -> None:
    g = torch.Generator().manual_seed(1)
    n, k, h, e = 5, 3, 4, 6
    rows, skip1, skip2 = torch.randn(n * k, h, generator=g), torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    bias, scales = torch.randn(e, h, generator=g), torch.rand(n, k, generator=g)
    src_to_dst = torch.randperm(n * k, generator=g).int()
    experts = torch.randint(0, e, (n, k), generator=g, dtype=torch.int32)
    got = ref.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src_to_dst, experts, drop_pad_mode=0)
    want = skip1 + skip2
    for i in range(n):  # the document's loop
        for j in range(k):
            want[i] += scales[i, j] * (rows[src_to_dst[j * n + i]] + bias[experts[i, j]])
    torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="skip2 needs skip1"):
        ref.npu_moe_finalize_routing(rows, None, skip2, None, scales, src_to_dst, experts)


# -- the layer and the model -------------------------------------------------------------------------

def moe_weights(num_experts: int, hidden: int, inter: int, top_k: int, norm: bool, dtype: torch.dtype) -> MoeWeights:
    g = torch.Generator().manual_seed(num_experts * 7 + hidden)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(dtype)  # noqa: E731
    return MoeWeights(router=r(hidden, num_experts) * 5, gate_up=r(num_experts, hidden, 2 * inter),
                      down=r(num_experts, inter, hidden), top_k=top_k, norm_topk_prob=norm)


@pytest.mark.parametrize("tokens, experts, top_k, norm", [(1, 4, 2, True), (9, 8, 3, False), (40, 6, 2, True),
                                                          (0, 4, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_npu_moe_matches_the_reference(npu, tokens: int, experts: int, top_k: int, norm: bool,
                                       dtype: torch.dtype) -> None:
    w = moe_weights(experts, 32, 24, top_k, norm, dtype)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    got, want = npu_moe(x, w), torch_moe(x, w)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the final sum rounds once, the reference's k times
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if tokens:
        assert [name for name, _ in npu.calls] == ["npu_moe_gating_top_k_softmax", "npu_moe_init_routing",
                                                   "npu_grouped_matmul", "npu_grouped_matmul",
                                                   "npu_moe_finalize_routing"]


@pytest.mark.parametrize("world", [2, 4])
def test_npu_moe_expert_parallel_parts_sum_to_the_layer(npu, world: int) -> None:
    w = moe_weights(8, 32, 24, 3, True, torch.float32)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(4))
    parts = [npu_moe(x, part) for part in split_experts(w, world)]
    for part, out in zip(split_experts(w, world), parts):
        torch.testing.assert_close(out, torch_moe(x, part), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(parts).sum(0), torch_moe(x, w), rtol=1e-5, atol=1e-5)


def test_a_model_on_the_npu_moe_generates_the_torch_tokens(monkeypatch, make_checkpoint) -> None:
    """The runtime's ops with the npu MoE (what an npu device runs; attention stays the cpu's):
    the torch MoE's tokens, fp32 logits within 1e-5."""
    path = make_checkpoint("moe-npu", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    npu = fake_torch_npu()  # after transformers wrote the checkpoint: it probes for a real torch_npu
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 9, 20)]
    results = []
    for moe in (torch_moe, npu_moe):
        rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=3, max_seq_len=64,
                                       page_size=8))
        rt.ops = replace(rt.ops, moe=moe)
        results.append(LocalDriver(rt).run([LocalRequest(p, 8) for p in prompts], keep_logits=True))
    assert any(name == "npu_grouped_matmul" for name, _ in npu.calls)
    assert results[1].token_ids == results[0].token_ids
    for mine, want in zip(results[1].logits, results[0].logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(want), rtol=1e-5, atol=1e-5)
