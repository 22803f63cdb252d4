"""cpu_prepack: the cpu path's linear layers on oneDNN with prepacked weights give the tokens of
the plain torch.mm path, logits within fp32 rounding; the option's refusals; a steady decode step
still allocates nothing and copies nothing to the device."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from chip_child.local import LocalDriver, LocalRequest
from chip_child.models.qwen3 import PROJECTIONS
from chip_child.models import prepack
from chip_child.models.prepack import PackedLinear, resolve_cpu_prepack
from chip_child.protocol import Admit, Command, prefill_command
from chip_child.step.runtime import ChipRuntime, RuntimeConfig
from l3worker import DistributedWorker, SamplingParams

from parity import assert_matches_transformers  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# Prepacked and plain may sum the same products in another order: fp32 logits can differ in the
# last bits. Measured: identical on these checkpoints, up to 1.2e-6 of the largest logit on a
# 4-layer model of hidden size 256; bounded well above that.
LOGITS_REL_TOL = 1e-5
# Tied embeddings with a bias, and untied without: both lm_head cases and both linear kinds.
CHECKPOINTS = {"default": {}, "tied-bias": dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1)}
# Big enough that some matrices are packed by the default size rule and others are not: qkv,
# gate_up and down at 2^17 elements or more; o_proj (256 x 256) and the lm_head (300 x 256) below.
SIZED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture
def pack_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matrix of the tiny test checkpoints packed (in this process), not only the large ones."""
    monkeypatch.setattr(prepack, "MIN_PACKED_ELEMENTS", 0)


def runtime(path: Path, cpu_prepack: bool | None, batch: int = 4) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=batch,
                                     max_seq_len=96, page_size=4, cpu_prepack=cpu_prepack))


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in (1, 6, 17, 40)]


# -- the option -------------------------------------------------------------------------------------
def test_default_is_on_for_the_cpu_only() -> None:
    assert resolve_cpu_prepack(None, "cpu", torch.float32) is True
    assert resolve_cpu_prepack(None, "cuda", torch.float32) is False
    assert resolve_cpu_prepack(None, "npu", torch.bfloat16) is False
    assert resolve_cpu_prepack(False, "cpu", torch.float32) is False


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_true_off_the_cpu_is_refused_by_name(device: str) -> None:
    with pytest.raises(ValueError, match=f"cpu_prepack=True cannot be used: it is for the cpu device, got {device}"):
        resolve_cpu_prepack(True, device, torch.float32)


def test_without_onednn_default_is_off_and_true_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert resolve_cpu_prepack(None, "cpu", torch.float32) is False
    with pytest.raises(ValueError, match=r"cpu_prepack=True cannot be used: .*without oneDNN"):
        resolve_cpu_prepack(True, "cpu", torch.float32)


def test_unsupported_dtype_default_is_off_and_true_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    assert resolve_cpu_prepack(None, "cpu", torch.float16) is False
    with pytest.raises(ValueError, match=r"cpu_prepack=True cannot be used: oneDNN does not support torch.float16"):
        resolve_cpu_prepack(True, "cpu", torch.float16)


def test_not_a_bool_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cpu_prepack must be a bool or None"):
        resolve_cpu_prepack("yes", "cpu", torch.float32)


def test_worker_refuses_before_starting_a_child(make_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint("default")
    with pytest.raises(TypeError, match="cpu_prepack"):
        DistributedWorker(ckpt, device="cpu", cpu_prepack=1)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cpu_prepack=True"):
        DistributedWorker(ckpt, device="cpu", cpu_prepack=True)


# -- the op -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_mm(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)  # [out, in], stored transposed as the model keeps it
    x = torch.randn(rows, 64, generator=g)[:, :64]
    b = torch.randn(96, generator=g) if bias else None
    packed = PackedLinear(w.t())
    want = x @ w.t() + (b if bias else 0)
    assert (packed.in_features, packed.out_features) == (64, 96)
    torch.testing.assert_close(packed(x, b), want, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_a_noncontiguous_input() -> None:
    w, x = torch.randn(32, 16), torch.randn(5, 40)[:, 3:19]
    torch.testing.assert_close(PackedLinear(w.t())(x), x @ w.t(), rtol=1e-5, atol=1e-5)


# -- through the runtime and the worker ----------------------------------------------------------------
def test_small_matrices_stay_plain(make_checkpoint) -> None:
    rt = runtime(make_checkpoint("sized", **SIZED), cpu_prepack=None)
    try:
        kinds = {p: {type(getattr(lw, p)) for lw in rt.weights.layers} for p in PROJECTIONS}
        assert kinds == {"qkv": {PackedLinear}, "o_proj": {torch.Tensor}, "gate_up": {PackedLinear},
                         "down": {PackedLinear}}
        assert type(rt.weights.lm_head) is torch.Tensor
    finally:
        rt.close()


def test_weights_are_replaced_not_duplicated(make_checkpoint, pack_all) -> None:
    """Every projection and the lm_head is packed, no plain copy kept beside it (a tied model's
    embedding stays: the token lookup reads it)."""
    for name, overrides in CHECKPOINTS.items():
        rt = runtime(make_checkpoint(name, **overrides), cpu_prepack=None)
        try:
            assert rt.cpu_prepack
            w = rt.weights
            assert all(type(getattr(lw, p)) is PackedLinear for lw in w.layers for p in PROJECTIONS)
            assert type(w.lm_head) is PackedLinear and isinstance(w.embed, torch.Tensor)
        finally:
            rt.close()


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_prepacked_and_plain_give_the_same_tokens(make_checkpoint, hf_model, pack_all, name: str) -> None:
    path = make_checkpoint(name, **CHECKPOINTS[name])
    vocab = hf_model(path).config.vocab_size
    requests = [LocalRequest(p, 24) for p in prompts(vocab)]
    results = {}
    for on in (False, True):
        rt = runtime(path, cpu_prepack=on)
        try:
            assert rt.cpu_prepack is on
            results[on] = LocalDriver(rt).run(requests, keep_logits=True)
        finally:
            rt.close()
    plain, packed = results[False], results[True]
    assert packed.token_ids == plain.token_ids
    for mine, theirs in zip(packed.logits, plain.logits):
        for a, b in zip(mine, theirs):
            assert ((a - b).abs().max() / b.abs().max()).item() <= LOGITS_REL_TOL
    for result in (packed, plain):  # the plain path: the switch and the benchmark's baseline
        assert_matches_transformers(hf_model(path), prompts(vocab), result.token_ids, result.logits, 24)


def test_steady_prepacked_decode_step_allocates_and_copies_nothing(make_checkpoint, pack_all) -> None:
    rt = runtime(make_checkpoint("default"), cpu_prepack=True, batch=3)
    try:
        out, staging = torch.zeros(3, dtype=torch.int32), np.arange(15, dtype=np.int32)
        pages = [np.arange(1 + 6 * r, 7 + 6 * r, dtype=np.int32) for r in range(3)]  # 24 positions a row
        admits = [(Admit(row=r, prompt_len=5, temperature=0.0, top_p=1.0, top_k=0, seed=0), pages[r], 5 * r)
                  for r in range(3)]
        rt.execute(prefill_command(0, admits), staging, out)
        for step in range(1, 12):
            result = rt.execute(Command(step=step), staging, out)
            assert (result.pool_allocs, result.h2d_copies, result.h2d_bytes) == (0, 0, 0)
        assert rt.pool.allocations == rt.warm_pool_allocations
    finally:
        rt.close()


def test_worker_prepacked_and_plain_give_the_same_tokens(make_checkpoint) -> None:
    ckpt = make_checkpoint("sized", **SIZED)  # the child packs by the default size rule
    rng = np.random.default_rng(3)
    batch = [rng.integers(0, 300, n).tolist() for n in (4, 11, 2, 19)]
    tokens, flags = {}, {}
    for on in (None, False):
        with DistributedWorker(ckpt, device="cpu", max_batch_size=3, max_seq_len=64, page_size=8, num_threads=1,
                               cpu_prepack=on) as w:
            tokens[on] = [o.token_ids for o in w.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=20), use_tqdm=False)]
            flags[on] = w.stats()["cpu_prepack"]
    assert flags == {None: True, False: False}
    assert tokens[None] == tokens[False]


def test_serve_flag_parses_to_the_option() -> None:
    from l3worker.serving.cli import build_parser

    parse = build_parser().parse_args
    assert [parse(["serve", *flag]).cpu_prepack for flag in ([], ["--cpu-prepack"], ["--no-cpu-prepack"])] == \
        [None, True, False]
