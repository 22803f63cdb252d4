"""The AVX-512 BF16 projection kernel (chip_child.cpu_kernels.bf16_linear): it agrees with a
float32 matmul at every tile edge, a row's result does not depend on the rows beside it, the
model's projections take it in bf16 and give the tokens of torch.mm, and where it cannot be used
the projections go to the next that can (tests/models/test_cpu_bf16_linear_avx2.py has the AVX2
kernel) with the reason said. The AMX kernel, which takes the matrices it
fits where the cpu has AMX, is off here (tests/models/test_cpu_bf16_amx.py has it)."""
from __future__ import annotations

import pytest
import torch

from chip_child.cpu_kernels import bf16_amx, bf16_linear, build
from chip_child.models.prepack import PackedLinear, cpu_linear_kernel, prepacked

from kernel_helpers import (assert_bf16_model_matches_torch_mm, assert_packed_linear_matches_float32,  # noqa: E402
                            assert_rows_independent, bf16_without_our_kernels, decide_again)

needs_kernel = pytest.mark.skipif(not bf16_linear.KERNEL.usable(), reason=f"kernel unusable here: {bf16_linear.KERNEL.why_not()}")


@pytest.fixture(autouse=True)
def avx512_only(monkeypatch) -> None:
    decide_again(monkeypatch, bf16_amx.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_amx")


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 17, 64, 65, 70])
@pytest.mark.parametrize("out_in", [(64, 64), (67, 33), (67, 129), (130, 768), (1000, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32(rows: int, out_in: tuple[int, int], bias: bool) -> None:
    """Blocks of 64 outputs (a partial last block at 67, 130, 1000), k in pairs (an odd 33 and 129),
    up to 4 rows in one micro-tile that streams the block (1, 2, 3, 4), micro-tiles of 4 rows (partial
    at 5, 17, 65, 70), from 5 to 64 rows k in chunks of 32 pairs (129: two and the odd last k)."""
    assert_packed_linear_matches_float32("avx512_bf16", rows, *out_in, bias)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Batch invariance: the same row alone, in a batch of 5, of 37 (k in chunks) and of 70 (whole
    k) gives the same bits."""
    assert_rows_independent(321, (0, 3, 36, 69), ((2, 7), (0, 37)))


@needs_kernel
def test_kernel_refuses_a_float32_input() -> None:
    layer = PackedLinear(torch.randn(64, 32).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 inputs, got torch.float32"):
        layer(torch.randn(2, 64))


def test_float32_stays_on_onednn() -> None:
    assert PackedLinear(torch.randn(64, 32)).kernel == "onednn"


@needs_kernel
def test_model_in_bf16_gives_the_tokens_of_torch_mm(make_checkpoint) -> None:
    """Every projection and the lm_head on the kernel (small ones too: its call is cheaper than
    torch.mm's), the greedy tokens of the plain torch.mm path, logits within bf16 rounding."""
    assert_bf16_model_matches_torch_mm(make_checkpoint("default"), "avx512_bf16")


def test_forced_reference_keeps_onednn_and_says_why(monkeypatch, capsys) -> None:
    decide_again(monkeypatch, bf16_linear.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_linear")
    assert not bf16_linear.KERNEL.usable()
    assert bf16_linear.KERNEL.why_not() == "forced by L3WORKER_REFERENCE_KERNELS"
    assert "not the cpu_bf16_linear kernel: forced by L3WORKER_REFERENCE_KERNELS" in capsys.readouterr().err
    assert cpu_linear_kernel(True, torch.bfloat16) == bf16_without_our_kernels()  # the AVX2 kernel is off too
    layer = prepacked(torch.randn(512, 512).bfloat16().t())  # big enough for oneDNN
    assert (layer.kernel if isinstance(layer, PackedLinear) else None) == bf16_without_our_kernels()


def test_a_failed_build_keeps_onednn_and_says_why(monkeypatch, tmp_path, capsys) -> None:
    decide_again(monkeypatch, bf16_linear.KERNEL)
    monkeypatch.setattr(build, "missing_cpu_flags", lambda flags: None)  # as on a cpu that has them
    monkeypatch.setenv("L3WORKER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    assert not bf16_linear.KERNEL.usable()
    assert "failed" in bf16_linear.KERNEL.why_not() and "bf16_linear.cpp" in bf16_linear.KERNEL.why_not()
    assert "not the cpu_bf16_linear kernel" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no partial library left behind


def test_a_cpu_without_the_instructions_is_named(monkeypatch) -> None:
    decide_again(monkeypatch, bf16_linear.KERNEL)
    monkeypatch.setattr(bf16_linear.KERNEL, "cpu_flags", ("fpu", "no_such_flag"))
    assert build.missing_cpu_flags(bf16_linear.KERNEL.cpu_flags) == "this cpu lacks no_such_flag"
    assert not bf16_linear.KERNEL.usable()


@needs_kernel
def test_the_library_is_built_once_per_source(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("L3WORKER_KERNEL_CACHE", str(tmp_path))
    flags = build.AVX512_BF16_FLAGS
    first = build.build("bf16_linear.cpp", flags)
    stamp = first.stat().st_mtime_ns
    assert build.build("bf16_linear.cpp", flags) == first and first.stat().st_mtime_ns == stamp
    other = build.build("bf16_linear.cpp", [*flags, "-DL3_TEST_VARIANT"])
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
