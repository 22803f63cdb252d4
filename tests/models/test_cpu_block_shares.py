"""How the bf16 projection kernels (AVX-512 BF16 and AVX2) share a call's weight blocks between
threads (chip_child/cpu_kernels/block_shares.h): each thread takes its own run of 64-column blocks
from the front, then the other runs' leftovers from their backs. Every block is computed once,
whatever the number of threads, with the bits one thread gives. And a kernel that fails its
self-check on a cpu with its instructions fails here: elsewhere its tests would only skip."""
from __future__ import annotations

import pytest
import torch

from chip_child.cpu_kernels import bf16_linear, build
from chip_child.cpu_kernels.build import CheckedKernel

from kernel_helpers import decide_again  # noqa: E402

KERNELS = [pytest.param(bf16_linear.KERNEL, id="avx512_bf16"), pytest.param(bf16_linear.AVX2_KERNEL, id="avx2")]


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_passes_its_self_check_on_a_cpu_with_its_instructions(monkeypatch,
                                                                        kernel: CheckedKernel) -> None:
    missing = build.missing_cpu_flags(kernel.cpu_flags)
    if missing:
        pytest.skip(missing)
    decide_again(monkeypatch, kernel)
    assert kernel.usable(), kernel.why_not()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("threads", [2, 3, 9, 70])
def test_every_block_is_written_once_on_any_number_of_threads(kernel: CheckedKernel, rows: int,
                                                              threads: int) -> None:
    """8 blocks, the last partial: uneven runs (3 threads), more threads than blocks (9), more than
    block_shares.h's 64 runs (70). The output starts as NaN, so a block left out shows."""
    lib = kernel.library()
    if lib is None:
        pytest.skip(kernel.why_not())
    g = torch.Generator().manual_seed(rows + threads)
    n, k = 64 * 7 + 3, 96
    packed = bf16_linear.pack(lib, torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(rows, k, generator=g).bfloat16()
    outs = []
    for t in (1, threads):
        y = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        lib.l3_bf16_linear(x.data_ptr(), k, packed.data_ptr(), None, y.data_ptr(), n, rows, n, k, t)
        assert not y.isnan().any(), f"{t} threads left columns unwritten"
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
