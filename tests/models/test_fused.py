"""The fused layer stages (chip_child.models.fused) against the torch reference (model.TORCH_OPS): each op
on random inputs, and whole runtimes with and without them. On a machine without a GPU the
kernels run under Triton's interpreter."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from chip_child.config import RuntimeConfig  # noqa: E402
from chip_child.models.fused import resolve_fused_kernels  # noqa: E402
from chip_child.local import LocalDriver, LocalRequest  # noqa: E402
from chip_child.models.qwen3 import TORCH_OPS, rope_table  # noqa: E402
from chip_child.step.runtime import ChipRuntime  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the same arithmetic in another order. bf16: a rounding step or two apart where an fp32
# sum's last bits move a value across a rounding boundary (values here reach magnitude 4, where a
# bf16 step is 0.016); the interpreter's casts to bf16 truncate, so its results drift further.
BF16_ATOL = 3.2e-2 if DEVICE == "cuda" else 6.3e-2
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=BF16_ATOL)}


@pytest.fixture(scope="module")
def fused():
    from chip_child.models.fused import triton_layer_ops

    return triton_layer_ops()


class Consts:
    """The fields of Qwen3Weights the ops read."""

    def __init__(self, hidden: int, head_dim: int, eps: float = 1e-6):
        scalar = lambda v: torch.tensor(v, dtype=torch.float32, device=DEVICE)  # noqa: E731
        self.eps, self.eps_value = scalar(eps), eps
        self.inv_hidden, self.inv_head_dim = scalar(1 / hidden), scalar(1 / head_dim)


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 96), (33, 1024), (0, 64)])
def test_add_rms_norm_matches_the_reference(fused, dtype, tokens: int, hidden: int) -> None:
    torch.manual_seed(tokens * hidden)
    h, delta = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, scale=0.5)
    weight = randn(hidden, dtype=dtype, scale=0.2) + 1
    w = Consts(hidden, 16)
    for d in (delta, None):
        want_h, want_x = TORCH_OPS.add_rms_norm(h, d, weight, w)
        got_h, got_x = fused.add_rms_norm(h, d, weight, w)
        if DEVICE == "cuda" or dtype == torch.float32:
            assert torch.equal(got_h, want_h), "the residual sum is one rounding of h + delta, as torch's add"
        else:  # the interpreter's casts to bfloat16 truncate instead of rounding to nearest
            torch.testing.assert_close(got_h, want_h, **TOLERANCE[dtype])
        torch.testing.assert_close(got_x, want_x, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 24), (7, 16, 8, 128), (3, 3, 1, 16),
                                                            (0, 4, 2, 24)])
@pytest.mark.parametrize("normed", [True, False], ids=["qk-norm", "rope-only"])
def test_qk_norm_rope_matches_the_reference(fused, dtype, tokens: int, heads: int, kv_heads: int,
                                            head_dim: int, normed: bool) -> None:
    """On the q|k part of a fused projection output (a strided view), at scattered positions;
    without q/k norm weights (Llama, Qwen2, Mistral) rotated only."""
    from chip_child.models.loader import ModelConfig

    torch.manual_seed(tokens + heads)
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, max_position_embeddings=512,
                      torch_dtype="float32", eos_token_ids=())
    rope = rope_table(cfg, 512, dtype, torch.device(DEVICE))
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, scale=2.0)
    weight = (randn(heads + kv_heads, head_dim, dtype=dtype, scale=0.2) + 1).contiguous() if normed else None
    positions = torch.randint(0, 512, (tokens,), device=DEVICE)
    w = Consts(64, head_dim)
    qk = qkv[:, :heads + kv_heads]
    want = TORCH_OPS.qk_norm_rope(qk, weight, TORCH_OPS.rope_rows(rope, positions), w)
    v_before = qkv[:, heads + kv_heads:].clone()
    got = fused.qk_norm_rope(qk, weight, fused.rope_rows(rope, positions), w)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, heads + kv_heads:], v_before), "v must be left as it was"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,inter", [(1, 96), (9, 3072), (0, 8)])
def test_silu_mul_matches_the_reference(fused, dtype, tokens: int, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = randn(tokens, 2 * inter, dtype=dtype, scale=3.0)
    torch.testing.assert_close(fused.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up), **TOLERANCE[dtype])


def test_runtime_with_fused_kernels_gives_the_reference_tokens_and_logits(make_checkpoint) -> None:
    path = make_checkpoint("fused", seed=11, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    results = {}
    for setting in (False, True):
        rt = ChipRuntime(RuntimeConfig(str(path), device=DEVICE, dtype="float32", max_batch_size=3, max_seq_len=64,
                                       page_size=8, fused_kernels=setting, decode_graphs=False))
        assert rt.ops.name == ("triton" if setting else "torch")
        # each kernel passed its self-check at start-up, and runs
        # (on cuda the attention backend, triton, checks itself too: not this test's subject)
        assert [(v.kernel, v.used) for v in rt.kernel_checks if v.kernel != "attention"] == \
            ([("add_rms_norm", True), ("qk_norm_rope", True), ("silu_mul", True)] if setting else [])
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 9, 20)]
        results[setting] = LocalDriver(rt).run([LocalRequest(p, 12) for p in prompts], keep_logits=True)
    assert results[True].token_ids == results[False].token_ids
    for mine, want in zip(results[True].logits, results[False].logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(want), rtol=1e-5, atol=1e-5)


def _runtime(path, **overrides) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device=DEVICE, dtype="float32", max_batch_size=2, max_seq_len=64,
                                     page_size=8, decode_graphs=False, **overrides))


def test_a_kernel_that_fails_its_self_check_falls_back_to_the_reference_and_says_so(make_checkpoint, monkeypatch,
                                                                                    capsys) -> None:
    from chip_child.models import fused as fused_module

    path = make_checkpoint("fused", seed=11, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    real = fused_module.triton_layer_ops()
    wrong = dataclasses.replace(real, silu_mul=lambda gate_up: real.silu_mul(gate_up) * 1.5)  # injected error
    monkeypatch.setattr("chip_child.step.runtime.triton_layer_ops", lambda: wrong)
    rt = _runtime(path, fused_kernels=True)
    verdicts = {v.kernel: v for v in rt.kernel_checks}
    assert not verdicts["silu_mul"].used and verdicts["silu_mul"].error > 0.1
    assert verdicts["add_rms_norm"].used and verdicts["qk_norm_rope"].used
    assert rt.ops.silu_mul is TORCH_OPS.silu_mul and rt.ops.add_rms_norm is real.add_rms_norm
    assert "kernel silu_mul failed its self-check" in capsys.readouterr().err
    prompts = [[5, 6, 7, 8], list(range(30, 50))]
    got = LocalDriver(rt).run([LocalRequest(p, 8) for p in prompts]).token_ids
    want = LocalDriver(_runtime(path, fused_kernels=False)).run([LocalRequest(p, 8) for p in prompts]).token_ids
    assert got == want


def test_reference_kernels_can_be_forced_by_name(make_checkpoint, monkeypatch) -> None:
    path = make_checkpoint("fused", seed=11, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "qk_norm_rope")
    rt = _runtime(path, fused_kernels=True)
    verdicts = {v.kernel: v for v in rt.kernel_checks}
    assert verdicts["qk_norm_rope"].error is None and not verdicts["qk_norm_rope"].used
    assert rt.ops.qk_norm_rope is TORCH_OPS.qk_norm_rope and rt.ops.rope_rows is TORCH_OPS.rope_rows
    assert verdicts["silu_mul"].used
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "qk_rope")
    with pytest.raises(ValueError, match="L3WORKER_REFERENCE_KERNELS: unknown kernel"):
        _runtime(path, fused_kernels=True)


def test_fused_kernels_option_resolution(monkeypatch) -> None:
    assert resolve_fused_kernels(None, "npu") is False
    assert resolve_fused_kernels(False, "cuda") is False
    with pytest.raises(ValueError, match="fused_kernels=True cannot run on npu"):
        resolve_fused_kernels(True, "npu")
    with pytest.raises(TypeError, match="fused_kernels must be a bool or None"):
        resolve_fused_kernels("yes", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_fused_kernels(None, "cpu") is False
    with pytest.raises(ValueError, match="fused_kernels=True cannot run on cpu"):
        resolve_fused_kernels(True, "cpu")


def test_worker_refuses_fused_kernels_it_cannot_run_before_any_child_starts(make_checkpoint, monkeypatch) -> None:
    from l3worker import DistributedWorker
    from l3worker.worker import distributed_worker as worker_module

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(worker_module, "ChildProcess", None)  # a child started would fail differently
    with pytest.raises(ValueError, match="fused_kernels=True cannot run on cpu"):
        DistributedWorker(make_checkpoint("default"), device="cpu", fused_kernels=True)
