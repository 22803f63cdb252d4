"""The cpu's bf16 layer ops (chip_child.cpu_kernels.layer_ops, on AVX-512 or AVX2): each agrees with TORCH_OPS at
tile edges, strided inputs and both position dtypes; shapes they do not take run the reference;
the runtime uses them in bf16 and checks each at the model's shapes; they can be turned off."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.cpu_kernels import layer_ops
from chip_child.models.qwen3 import TORCH_OPS
from chip_child.step.runtime import ChipRuntime

from kernel_helpers import decide_again  # noqa: E402

needs_kernel = pytest.mark.skipif(layer_ops.library() is None, reason="neither layer-ops kernel runs here")
KERNELS = {"avx512": layer_ops.KERNEL, "avx2": layer_ops.AVX2_KERNEL}
BF16 = torch.bfloat16
REL_TOL = 1e-2  # a bf16 rounding or two: the kernels round where torch does, summing in another order


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def norms(n: int, head_dim: int = 64) -> SimpleNamespace:
    return SimpleNamespace(eps=torch.tensor(1e-6), eps_value=1e-6, inv_hidden=torch.tensor(1 / n),
                           inv_head_dim=torch.tensor(1 / head_dim))


@pytest.fixture(scope="module", params=list(KERNELS))
def ops(request):
    """The ops on each kernel (AVX-512, AVX2) where it runs here."""
    kernel = KERNELS[request.param]
    if not kernel.usable():
        pytest.skip(f"{kernel.name} unusable here: {kernel.why_not()}")
    return layer_ops.make_ops(kernel.library())


@pytest.mark.parametrize("tokens", [0, 1, 7, 40])
@pytest.mark.parametrize("hidden", [64, 768, 4096])  # 40 x 4096: over the threshold for threads
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(ops, tokens: int, hidden: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(tokens + hidden)
    h = torch.randn(tokens, hidden + 16, generator=g).to(BF16)[:, 16:]  # strided rows
    delta = torch.randn(tokens, hidden, generator=g).to(BF16) if with_delta else None
    weight, w = torch.randn(hidden, generator=g).to(BF16), norms(hidden)
    got, want = ops.add_rms_norm(h, delta, weight, w), TORCH_OPS.add_rms_norm(h, delta, weight, w)
    if not with_delta:
        assert got[0] is h  # no copy of the residual when nothing is added
    else:  # the residual sum is one rounding to nearest even, as torch's bf16 add: the same bits
        assert torch.equal(got[0], h + delta)
    for a, b in zip(got, want):
        assert a.shape == b.shape and (tokens == 0 or rel(a, b) <= REL_TOL)


@pytest.mark.parametrize("tokens", [0, 1, 9])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("normed", ["no", "one row", "a row per head"])  # a model's q_norm rows, then k_norm's
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_qk_norm_rope(ops, tokens: int, head_dim: int, normed: str, pos_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens * head_dim)
    heads = 6
    qkv = torch.randn(tokens, heads + 2, head_dim, generator=g).to(BF16)
    qk = qkv[:, :heads]  # the q and k heads of a fused qkv: strided tokens
    half = head_dim // 2
    freqs = torch.arange(64)[:, None] / 10000 ** (torch.arange(half) / half)
    emb = torch.cat([freqs, freqs], -1)
    rope = torch.stack([emb.cos(), emb.sin() * torch.cat([-torch.ones(half), torch.ones(half)])], 1).to(BF16)
    positions = (torch.arange(tokens) * 7 % 64).to(pos_dtype)
    rows = {"no": None, "one row": (head_dim,), "a row per head": (heads, head_dim)}[normed]
    weight = None if rows is None else torch.randn(*rows, generator=g).to(BF16)
    w = norms(head_dim * heads, head_dim)
    got = ops.qk_norm_rope(qk, weight, ops.rope_rows(rope, positions), w)
    want = TORCH_OPS.qk_norm_rope(qk, weight, TORCH_OPS.rope_rows(rope, positions), w)
    assert got.shape == want.shape and (tokens == 0 or rel(got, want) <= REL_TOL)


@pytest.mark.parametrize("tokens", [0, 1, 9, 40])
@pytest.mark.parametrize("inter", [96, 101, 3072])  # 101: a partial vector at each row's end
def test_silu_mul(ops, tokens: int, inter: int) -> None:
    gate_up = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(BF16)
    got, want = ops.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up)
    assert got.shape == want.shape and (tokens == 0 or rel(got, want) <= REL_TOL)


def test_shapes_the_kernels_do_not_take_run_the_reference(ops) -> None:
    h, weight, w = torch.randn(3, 72).to(BF16), torch.randn(72).to(BF16), norms(72)  # 72: not a multiple of 16
    for a, b in zip(ops.add_rms_norm(h, h, weight, w), TORCH_OPS.add_rms_norm(h, h, weight, w)):
        assert torch.equal(a, b)
    h32 = torch.randn(3, 64)  # float32 rows
    assert torch.equal(ops.silu_mul(h32), TORCH_OPS.silu_mul(h32))


def test_float32_and_forced_reference_use_torch_ops(monkeypatch) -> None:
    assert layer_ops.cpu_layer_ops(torch.float32) is TORCH_OPS
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_layer_ops")
    decide_again(monkeypatch, layer_ops.KERNEL)
    assert layer_ops.cpu_layer_ops(BF16) is TORCH_OPS and layer_ops.KERNEL.why_not() == "forced by L3WORKER_REFERENCE_KERNELS"


@needs_kernel
@pytest.mark.parametrize("fused_kernels", [None, False])
def test_the_runtime_uses_them_in_bf16_and_checks_each(make_checkpoint, fused_kernels) -> None:
    rt = ChipRuntime(RuntimeConfig(str(make_checkpoint("default")), device="cpu", dtype="bfloat16", max_batch_size=2,
                                   max_seq_len=64, page_size=8, fused_kernels=fused_kernels))
    try:
        checks = {v.kernel: v.used for v in rt.kernel_checks if v.kernel != "attention"}
        if fused_kernels is None:
            assert rt.ops.name == "cpu"
            assert checks == {"add_rms_norm": True, "qk_norm_rope": True, "silu_mul": True}
        else:  # turned off: the reference
            assert rt.ops is TORCH_OPS and checks == {}
    finally:
        rt.close()
