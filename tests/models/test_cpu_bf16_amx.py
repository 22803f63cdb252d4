"""The AMX projection kernel (chip_child.cpu_kernels.bf16_amx): it agrees with a float32 matmul at
every tile edge, a row's result is the same bits at every batch size, the projections whose K fits
take it (the others stay on the AVX-512 kernel) and give the tokens of torch.mm, and where it
cannot be used the projections stay on the AVX-512 kernel with the reason said."""
from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest
import torch

from chip_child.cpu_kernels import bf16_amx, bf16_linear, build
from chip_child.cpu_kernels.build import KernelBuildError
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.prepack import PackedLinear
from chip_child.models.qwen3 import PROJECTIONS
from chip_child.step.runtime import ChipRuntime, RuntimeConfig

from kernel_helpers import decide_again  # noqa: E402

needs_amx = pytest.mark.skipif(not bf16_amx.KERNEL.usable(), reason=f"AMX kernel unusable here: {bf16_amx.KERNEL.why_not()}")
REL_TOL = 1e-2  # bf16 output: one rounding of an fp32 sum (2^-8 relative), summed in another order than torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 128])
@pytest.mark.parametrize("out_in", [(64, 32), (67, 96), (130, 768), (1000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32(rows: int, out_in: tuple[int, int], bias: bool) -> None:
    """C tiles of 16 outputs in blocks of 64 (a partial last block at 67, 130, 1000), A tiles of
    16 rows (partial at 1, 15, 17, 33), k in tiles of 32 (one at 32, three at 96)."""
    n, k = out_in
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k + 3, generator=g).bfloat16()[:, 2:k + 2]  # strided rows, offset start
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    layer = PackedLinear(w.t())
    assert layer.kernel == "amx_bf16"
    got = layer(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    if rows:
        want = x.float() @ w.float().t() + (b.float() if bias else 0)
        assert rel_error(got, want) <= REL_TOL


@needs_amx
def test_a_rows_result_is_the_same_bits_at_every_batch_size() -> None:
    """A decode row alone, with 4 others, in a full tile, past it, and in a prompt chunk of 70."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, 320, generator=g).bfloat16(), torch.randn(70, 320, generator=g).bfloat16()
    layer = PackedLinear(w.t())
    whole = layer(x)
    for i in (0, 15, 16, 69):
        assert torch.equal(layer(x[i:i + 1]), whole[i:i + 1])
    for lo, hi in ((2, 7), (0, 16), (0, 17), (20, 53)):
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi])


@needs_amx
def test_a_k_the_tiles_do_not_fit_stays_on_the_avx512_kernel() -> None:
    """Per matrix, at load: its bits then never depend on which rows a step carries."""
    assert PackedLinear(torch.randn(64, 64).bfloat16()).kernel == "amx_bf16"
    assert PackedLinear(torch.randn(33, 64).bfloat16()).kernel == "avx512_bf16"
    assert PackedLinear(torch.randn(80, 64).bfloat16()).kernel == "avx512_bf16"


@needs_amx
def test_model_in_bf16_on_amx_gives_the_tokens_of_torch_mm(make_checkpoint) -> None:
    """Every projection and the lm_head on AMX (the default checkpoint's sizes are multiples of 32)."""
    path = make_checkpoint("default")
    requests = [LocalRequest(list(range(3, 3 + n)), 16) for n in (1, 6, 17)]
    results = {}
    for on in (False, True):
        rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="bfloat16", max_batch_size=4,
                                       max_seq_len=96, page_size=4, cpu_prepack=on))
        try:
            if on:
                assert rt.cpu_linear == "amx_bf16"
                layers = [getattr(lw, p) for lw in rt.weights.layers for p in PROJECTIONS]
                assert {layer.kernel for layer in [*layers, rt.weights.lm_head]} == {"amx_bf16"}
            results[on] = LocalDriver(rt).run(requests, keep_logits=True)
        finally:
            rt.close()
    assert results[True].token_ids == results[False].token_ids
    for mine, theirs in zip(results[True].logits, results[False].logits):
        assert rel_error(mine[0], theirs[0].float()) <= 5e-2


@needs_amx
def test_forced_reference_keeps_the_avx512_kernel_and_says_why(monkeypatch, capsys) -> None:
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_amx")
    assert not bf16_amx.KERNEL.usable()
    assert ("bf16 projections run on the AVX-512 kernel, not the cpu_bf16_amx kernel: forced by "
            "L3WORKER_REFERENCE_KERNELS") in capsys.readouterr().err
    assert PackedLinear(torch.randn(64, 64).bfloat16()).kernel == "avx512_bf16"


def test_without_the_avx512_kernel_amx_is_not_used_either(monkeypatch) -> None:
    """AMX takes only the matrices our AVX-512 kernel would: with it off, bf16 stays on oneDNN."""
    decide_again(monkeypatch, bf16_linear.KERNEL)
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_linear")
    assert PackedLinear(torch.randn(64, 64).bfloat16()).kernel == "onednn"


def test_a_cpu_without_amx_is_named(monkeypatch) -> None:
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setattr(bf16_amx.KERNEL, "cpu_flags", ("avx512f", "no_amx_here"))
    assert not bf16_amx.KERNEL.usable()
    assert bf16_amx.KERNEL.why_not() == "this cpu lacks no_amx_here"


def test_a_process_refused_its_tiles_gets_the_reason() -> None:
    """Linux hands out AMX state per process (arch_prctl): a refusal is a build error with errno."""
    fn = lambda: SimpleNamespace(argtypes=None, restype=None)  # noqa: E731
    lib = SimpleNamespace(l3_bf16_packed_elements=fn(), l3_bf16_pack=fn(), l3_bf16_amx_linear=fn(),
                          l3_amx_init=lambda: errno.EPERM)
    with pytest.raises(KernelBuildError, match=r"refused this process AMX tiles \(EPERM: Operation not permitted\)"):
        bf16_amx._bind(lib)


@needs_amx
def test_both_libraries_pack_the_same_bytes() -> None:
    """One packed copy serves both kernels: each library exports the same packing."""
    w = torch.randn(130, 96).bfloat16()
    ours, amx = bf16_linear.KERNEL.library(), bf16_amx.KERNEL.library()
    assert torch.equal(bf16_linear.pack(ours, w), bf16_linear.pack(amx, w))
    assert build.missing_cpu_flags(bf16_amx.KERNEL.cpu_flags) is None
