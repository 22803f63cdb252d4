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
from chip_child.models.prepack import PackedLinear, cpu_linear_kernel

from kernel_helpers import (assert_bf16_model_matches_torch_mm, assert_packed_linear_matches_float32,  # noqa: E402
                            assert_rows_independent, bf16_without_our_kernels, decide_again, rule_out)

needs_amx = pytest.mark.skipif(not bf16_amx.KERNEL.usable(), reason=f"AMX kernel unusable here: {bf16_amx.KERNEL.why_not()}")


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 128])
@pytest.mark.parametrize("out_in", [(64, 32), (67, 96), (130, 768), (1000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32(rows: int, out_in: tuple[int, int], bias: bool) -> None:
    """C tiles of 16 outputs in blocks of 64 (a partial last block at 67, 130, 1000), A tiles of
    16 rows (partial at 1, 15, 17, 33), k in tiles of 32 (one at 32, three at 96)."""
    assert_packed_linear_matches_float32("amx_bf16", rows, *out_in, bias)


@needs_amx
def test_a_rows_result_is_the_same_bits_at_every_batch_size() -> None:
    """A decode row alone, with 4 others, in a full tile, past it, and in a prompt chunk of 70."""
    assert_rows_independent(320, (0, 15, 16, 69), ((2, 7), (0, 16), (0, 17), (20, 53)))


@needs_amx
def test_a_k_the_tiles_do_not_fit_stays_on_the_avx512_kernel() -> None:
    """Per matrix, at load: its bits then never depend on which rows a step carries."""
    assert PackedLinear(torch.randn(64, 64).bfloat16()).kernel == "amx_bf16"
    assert PackedLinear(torch.randn(33, 64).bfloat16()).kernel == "avx512_bf16"
    assert PackedLinear(torch.randn(80, 64).bfloat16()).kernel == "avx512_bf16"


@needs_amx
def test_model_in_bf16_on_amx_gives_the_tokens_of_torch_mm(make_checkpoint) -> None:
    """Every projection and the lm_head on AMX (the default checkpoint's sizes are multiples of 32)."""
    assert_bf16_model_matches_torch_mm(make_checkpoint("default"), "amx_bf16")


@needs_amx
def test_forced_reference_keeps_the_avx512_kernel_and_says_why(monkeypatch, capsys) -> None:
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_amx")
    assert not bf16_amx.KERNEL.usable()
    assert ("bf16 projections run on the AVX-512 kernel, not the cpu_bf16_amx kernel: forced by "
            "L3WORKER_REFERENCE_KERNELS") in capsys.readouterr().err
    assert PackedLinear(torch.randn(64, 64).bfloat16()).kernel == "avx512_bf16"


def test_without_the_avx512_kernel_amx_is_not_used_either(monkeypatch) -> None:
    """AMX takes only the matrices our AVX-512 kernel would: with our bf16 kernels off, bf16 goes
    to oneDNN (torch.mm where oneDNN has no bf16 on this cpu)."""
    decide_again(monkeypatch, bf16_linear.KERNEL)
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_linear")
    assert cpu_linear_kernel(True, torch.bfloat16) == bf16_without_our_kernels()


def test_beside_the_avx2_kernel_amx_is_not_used(monkeypatch) -> None:
    """AMX runs only beside the AVX-512 kernel: where the AVX2 one packs the matrices, not at all."""
    rule_out(monkeypatch, bf16_linear.KERNEL)
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setattr(bf16_linear, "AVX2_KERNEL", SimpleNamespace(library=lambda: "the AVX2 library"))
    assert cpu_linear_kernel(True, torch.bfloat16) == "avx2_bf16"
    assert not bf16_amx.KERNEL._decided  # not even built


def test_a_cpu_without_amx_is_named(monkeypatch) -> None:
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setattr(bf16_amx.KERNEL, "cpu_flags", ("fpu", "no_amx_here"))
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
