"""Helpers for tests of chip_child.cpu_kernels."""
from __future__ import annotations

import pytest
import torch

from chip_child.cpu_kernels.build import CheckedKernel
from chip_child.local import LocalDriver, LocalRequest
from chip_child.models import prepack
from chip_child.models.prepack import PackedLinear
from chip_child.models.qwen3 import PROJECTIONS
from chip_child.step.runtime import ChipRuntime, RuntimeConfig

# bf16 output: one rounding of an fp32 sum (2^-8 relative), summed in another order than torch.
REL_TOL = 1e-2


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def assert_packed_linear_matches_float32(kernel: str, rows: int, n: int, k: int, bias: bool) -> None:
    """A PackedLinear of [n, k] on `kernel`, its input rows strided and offset in their storage,
    against a float32 matmul."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k + 3, generator=g).bfloat16()[:, 2:k + 2]
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    layer = PackedLinear(w.t())
    assert layer.kernel == kernel
    got = layer(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    if rows:
        want = x.float() @ w.float().t() + (b.float() if bias else 0)
        assert rel_error(got, want) <= REL_TOL


def decide_again(monkeypatch: pytest.MonkeyPatch, kernel: CheckedKernel) -> None:
    """`kernel` decides again (build, check, environment) in this test; the process's verdict
    comes back after it."""
    for name, value in (("_decided", False), ("_lib", None), ("_why", None)):
        monkeypatch.setattr(kernel, name, value)


def bf16_without_our_kernels() -> str | None:
    """What runs bf16 projections where neither of our bf16 kernels does: oneDNN where it has bf16
    on this cpu, else torch.mm (None)."""
    return "onednn" if prepack._dtype_supported(torch.bfloat16) else None


def rule_out(monkeypatch: pytest.MonkeyPatch, kernel: CheckedKernel) -> None:
    """`kernel` counts as unusable in this test, as on a cpu without its instructions."""
    for name, value in (("_decided", True), ("_lib", None), ("_why", "ruled out by the test")):
        monkeypatch.setattr(kernel, name, value)


def assert_rows_independent(k: int, singles: tuple[int, ...], spans: tuple[tuple[int, int], ...]) -> None:
    """Batch invariance of a PackedLinear of [200, k]: rows alone and spans of a 70-row batch give
    the bits they give in the whole batch."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, k, generator=g).bfloat16(), torch.randn(70, k, generator=g).bfloat16()
    layer = PackedLinear(w.t())
    whole = layer(x)
    for i in singles:
        assert torch.equal(layer(x[i:i + 1]), whole[i:i + 1])
    for lo, hi in spans:
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi])


def assert_bf16_model_matches_torch_mm(path, kernel: str) -> None:
    """The checkpoint at `path` in bf16 with every projection and the lm_head packed on `kernel`
    gives the greedy tokens of the plain torch.mm path, logits within bf16 rounding."""
    requests = [LocalRequest(list(range(3, 3 + n)), 16) for n in (1, 6, 17)]
    results = {}
    for on in (False, True):
        rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="bfloat16", max_batch_size=4,
                                       max_seq_len=96, page_size=4, cpu_prepack=on))
        try:
            assert rt.cpu_linear == (kernel if on else None)
            if on:
                layers = [getattr(lw, p) for lw in rt.weights.layers for p in PROJECTIONS]
                assert {layer.kernel for layer in [*layers, rt.weights.lm_head]} == {kernel}
            results[on] = LocalDriver(rt).run(requests, keep_logits=True)
        finally:
            rt.close()
    assert results[True].token_ids == results[False].token_ids
    for mine, theirs in zip(results[True].logits, results[False].logits):
        assert rel_error(mine[0], theirs[0].float()) <= 5e-2
