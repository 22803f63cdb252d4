"""The AVX2 projection kernel (chip_child.cpu_kernels.bf16_linear.AVX2_KERNEL), for cpus without
AVX-512 BF16: it agrees with a float32 matmul at every tile edge, a row's result does not depend
on the rows beside it, the model's projections take it in bf16 and give the tokens of torch.mm,
and where it cannot be used the projections go to oneDNN or torch.mm with the reason said. The
AVX-512 kernel is ruled out here, so the tests run on cpus that have it too."""
from __future__ import annotations

import pytest
import torch

from chip_child.cpu_kernels import bf16_amx, bf16_linear
from chip_child.cpu_kernels.build import first_usable
from chip_child.models import prepack
from chip_child.models.prepack import PackedLinear, cpu_linear_kernel, prepacked, resolve_cpu_prepack

from kernel_helpers import (assert_bf16_model_matches_torch_mm, assert_packed_linear_matches_float32,  # noqa: E402
                            assert_rows_independent, bf16_without_our_kernels, decide_again, rule_out)

needs_avx2 = pytest.mark.skipif(not bf16_linear.AVX2_KERNEL.usable(),
                                reason=f"AVX2 kernel unusable here: {bf16_linear.AVX2_KERNEL.why_not()}")


@pytest.fixture(autouse=True)
def avx2_only(monkeypatch) -> None:
    rule_out(monkeypatch, bf16_linear.KERNEL)
    rule_out(monkeypatch, bf16_amx.KERNEL)


@needs_avx2
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 17, 70, 200])
@pytest.mark.parametrize("out_in", [(64, 64), (67, 33), (130, 768), (1000, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32(rows: int, out_in: tuple[int, int], bias: bool) -> None:
    """Blocks of 64 outputs (a partial last block and a partial last vector of 8 at 67, 130 and
    1000), k in pairs (an odd 33), 1 to 3 rows streaming the block, from 4 rows the block widened
    256 k at a time (three chunks at 768) under tiles of 6 rows (partial at 4, 5, 17, 70), rows in
    groups of 96 (200: two and 8 rows left, which take the few-rows path)."""
    assert_packed_linear_matches_float32("avx2_bf16", rows, *out_in, bias)


@needs_avx2
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Batch invariance: the same row alone (one pass over the block), in a batch of 5 and of 70
    (tiles of 4 over quarters) gives the same bits."""
    assert_rows_independent(321, (0, 3, 36, 69), ((2, 7), (0, 37)))


@needs_avx2
def test_a_rows_result_is_the_same_in_every_row_group() -> None:
    """Rows in groups of 96: a row gives the same bits alone, in a span across a group's edge, and
    in a batch of 200 whose last group has 8 rows."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(130, 300, generator=g).bfloat16(), torch.randn(200, 300, generator=g).bfloat16()
    layer = PackedLinear(w.t())
    whole = layer(x)
    for lo, hi in ((0, 1), (95, 98), (190, 200), (3, 199)):
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi])


@needs_avx2
def test_nan_and_rounding_as_torch() -> None:
    """One product per output (a diagonal weight): its fp32 value is exact, so the output is
    torch's round-to-nearest-even cast of it, bit for bit; a NaN input makes its row NaN."""
    c = torch.randn(64).bfloat16()
    x = (torch.randn(3, 64) * 1000).bfloat16()
    got = PackedLinear(torch.diag(c).t())(x)
    assert torch.equal(got, (x.float() * c.float()).bfloat16())
    x[1, 5] = float("nan")
    assert torch.equal(torch.isnan(PackedLinear(torch.diag(c).t())(x)), torch.isnan(x.float() @ torch.diag(c).float()))


@needs_avx2
def test_kernel_refuses_a_float32_input() -> None:
    layer = PackedLinear(torch.randn(64, 32).bfloat16())
    assert layer.kernel == "avx2_bf16"
    with pytest.raises(ValueError, match="bfloat16 inputs, got torch.float32"):
        layer(torch.randn(2, 64))


@needs_avx2
def test_both_libraries_pack_the_same_layout() -> None:
    """The AVX2 library exports the packing the AVX-512 one does (bf16_packing.h): the same bytes."""
    w = torch.randn(130, 96).bfloat16()
    packed = bf16_linear.pack(bf16_linear.AVX2_KERNEL.library(), w)
    blocks = torch.zeros(192, 96, dtype=torch.bfloat16)
    blocks[:130] = w  # [N / 64][K / 2][64][2], zero past N
    want = blocks.view(3, 64, 48, 2).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(packed, want)


@needs_avx2
def test_model_in_bf16_gives_the_tokens_of_torch_mm(make_checkpoint) -> None:
    """Every projection and the lm_head on the AVX2 kernel, the greedy tokens of the plain
    torch.mm path, logits within bf16 rounding."""
    assert_bf16_model_matches_torch_mm(make_checkpoint("default"), "avx2_bf16")


def test_forced_off_it_says_why_and_bf16_goes_on(monkeypatch, capsys) -> None:
    decide_again(monkeypatch, bf16_linear.AVX2_KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_linear_avx2")
    assert cpu_linear_kernel(True, torch.bfloat16) == bf16_without_our_kernels()
    assert ("bf16 projections run on oneDNN (or torch.mm where it has no bf16), not the cpu_bf16_linear_avx2 "
            "kernel: forced by L3WORKER_REFERENCE_KERNELS") in capsys.readouterr().err
    layer = prepacked(torch.randn(512, 512).bfloat16().t())
    assert (layer.kernel if isinstance(layer, PackedLinear) else None) == bf16_without_our_kernels()


def test_a_cpu_without_avx2_is_named(monkeypatch) -> None:
    decide_again(monkeypatch, bf16_linear.AVX2_KERNEL)
    monkeypatch.setattr(bf16_linear.AVX2_KERNEL, "cpu_flags", ("fpu", "no_avx2_here"))
    assert not bf16_linear.AVX2_KERNEL.usable()
    assert bf16_linear.AVX2_KERNEL.why_not() == "this cpu lacks no_avx2_here"


def test_bf16_prepacking_is_on_where_only_our_kernel_could_run_it(monkeypatch) -> None:
    """oneDNN without bf16 (as on AVX2 cpus): prepacking is on by default while the cpu has AVX2,
    off without it, and cpu_prepack=True there is a ValueError naming the field."""
    monkeypatch.setattr(prepack, "_dtype_supported", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(prepack, "missing_cpu_flags", lambda flags: None)
    assert resolve_cpu_prepack(None, "cpu", torch.bfloat16) is True
    monkeypatch.setattr(prepack, "missing_cpu_flags", lambda flags: "this cpu lacks avx2")
    assert resolve_cpu_prepack(None, "cpu", torch.bfloat16) is False
    with pytest.raises(ValueError, match="cpu_prepack=True cannot be used: oneDNN does not support torch.bfloat16"):
        resolve_cpu_prepack(True, "cpu", torch.bfloat16)
    assert resolve_cpu_prepack(None, "cpu", torch.float32) is True


def test_the_first_usable_version_is_taken_and_the_primarys_name_turns_all_off(monkeypatch, capsys) -> None:
    """first_usable, which chooses between the AVX-512 and AVX2 versions of every cpu kernel: the
    first whose library runs, None when none does, and the primary's name forced off turns the
    fallbacks off too (a fallback's own name only that fallback)."""
    decide_again(monkeypatch, bf16_linear.AVX2_KERNEL)
    primary, fallback = bf16_linear.KERNEL, bf16_linear.AVX2_KERNEL  # the primary is ruled out here
    expected = fallback if fallback.usable() else None
    assert first_usable(primary, fallback) is expected
    assert bf16_linear.best_kernel() == (None if expected is None else ("avx2_bf16", fallback.library()))
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", primary.name)
    decide_again(monkeypatch, bf16_linear.AVX2_KERNEL)
    assert first_usable(primary, fallback) is None and bf16_linear.best_kernel() is None
    assert not fallback._decided  # not even built
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", fallback.name)
    assert first_usable(primary, fallback) is None
    assert "not the cpu_bf16_linear_avx2 kernel: forced by L3WORKER_REFERENCE_KERNELS" in capsys.readouterr().err
