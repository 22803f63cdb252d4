"""A bf16 decode step's layers in one C call (chip_child.cpu_kernels.decode_layers): the runtime
takes it where the model fits, gives the bits of the layer-by-layer forward (tokens and logits),
checks that on its first step and refuses it when they differ, looks the weights up again after
a weight update, and says why where it cannot run."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chip_child.cpu_kernels import decode_layers
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step.controls import RuntimeControls
from chip_child.step.runtime import ChipRuntime, RuntimeConfig

from checkpoints import write_hf_checkpoint  # noqa: E402
from kernel_helpers import decide_again  # noqa: E402

needs_kernel = pytest.mark.skipif(not decode_layers.KERNEL.usable(),
                                  reason=f"unusable here: {decode_layers.KERNEL.why_not()}")
REQUESTS = [LocalRequest(list(range(3, 3 + n)), 14) for n in (1, 6, 17)]  # pages of 4: boundaries crossed


def checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A Qwen3 the kernels take (hidden 64, head size 32), every norm weight random as in a trained
    model, q_norm unlike k_norm (transformers initialises them all to ones)."""
    write_hf_checkpoint(path, seed=seed, head_dim=32, **overrides)
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = (1 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def runtime(path: Path, **options) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="bfloat16", max_batch_size=4, max_seq_len=64,
                                     page_size=4, **options))


def run(path: Path, **options):
    rt = runtime(path, **options)
    try:
        used = rt.decode_layers is not None and not rt.decode_layers.refused  # warm-up ran the first step
        return used, LocalDriver(rt).run(REQUESTS, keep_logits=True)
    finally:
        rt.close()


def layer_by_layer(monkeypatch: pytest.MonkeyPatch, path: Path, **options):
    """The run with the one-call layers turned off, then on again for the rest of the test."""
    with monkeypatch.context() as m:
        m.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_decode_layers")
        decide_again(m, decode_layers.KERNEL)
        used, result = run(path, **options)
    assert not used
    return result


def assert_same(a, b) -> None:
    assert a.token_ids == b.token_ids
    for mine, theirs in zip(a.logits, b.logits):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs))


@needs_kernel
def test_decode_steps_take_one_call_and_give_the_layer_by_layer_bits(tmp_path, monkeypatch) -> None:
    path = checkpoint(tmp_path / "ck")
    calls = []
    lib = decode_layers.KERNEL.library()
    real = lib.l3_decode_layers
    monkeypatch.setattr(lib, "l3_decode_layers", lambda *a: calls.append(a[1].rows) or real(*a))
    rt = runtime(path)
    try:
        checks = {v.kernel: v for v in rt.kernel_checks}
        assert checks["qk_norm_rope"].used  # q_norm and k_norm differ: each head reads its own row
        assert checks["decode_layers"].used and checks["decode_layers"].error == 0.0  # warm-up's first step
        calls.clear()
        mine = LocalDriver(rt).run(REQUESTS, keep_logits=True)
    finally:
        rt.close()
    assert len(calls) == 13 and set(calls) == {3}  # every decode step after the prefill, its 3 rows (lanes: 4)
    assert_same(mine, layer_by_layer(monkeypatch, path))


@needs_kernel
def test_a_first_step_that_differs_is_refused(tmp_path, monkeypatch, capfd) -> None:
    path = checkpoint(tmp_path / "ck")
    lib = decode_layers.KERNEL.library()
    real = lib.l3_decode_layers

    def off_by_one_bit(model, step, h, delta, work):
        real(model, step, h, delta, work)
        ctypes.c_uint16.from_address(delta).value ^= 1  # the last bit of the first row's first element

    monkeypatch.setattr(lib, "l3_decode_layers", off_by_one_bit)
    used, result = run(path)
    assert not used
    assert "decode steps run layer by layer from now on" in capfd.readouterr().err
    monkeypatch.undo()
    assert_same(result, layer_by_layer(monkeypatch, path))


@needs_kernel
def test_updated_weights_are_looked_up_again(tmp_path, monkeypatch) -> None:
    old, new = checkpoint(tmp_path / "old"), checkpoint(tmp_path / "new", seed=5)
    rt = runtime(old)
    try:
        LocalDriver(rt).run(REQUESTS)
        assert RuntimeControls(rt).handle("update_weights", {"dir": str(new)})["pending_tensors"] == []
        assert rt.decode_layers is not None
        mine = LocalDriver(rt).run(REQUESTS, keep_logits=True)
    finally:
        rt.close()
    assert_same(mine, layer_by_layer(monkeypatch, new))


@needs_kernel
@pytest.mark.parametrize("overrides, why", [
    (dict(head_dim=24), "head sizes of 32n"),  # the layer ops' rope takes whole vectors
    (dict(max_loras=1), "LoRA slots"),
])
def test_a_model_it_cannot_run_says_why_and_runs_layer_by_layer(tmp_path, capfd, overrides, why) -> None:
    head_dim = overrides.pop("head_dim", 32)
    path = write_hf_checkpoint(tmp_path / "ck", head_dim=head_dim)
    used, _ = run(path, **overrides)
    assert not used
    assert why in capfd.readouterr().err


def test_float32_does_not_ask_for_it(tmp_path, capfd) -> None:
    rt = ChipRuntime(RuntimeConfig(str(write_hf_checkpoint(tmp_path / "ck", head_dim=32)), device="cpu",
                                   max_batch_size=2, max_seq_len=32, page_size=4))
    try:
        assert rt.dtype == torch.float32 and rt.decode_layers is None
    finally:
        rt.close()
    assert "layer by layer" not in capfd.readouterr().err


@needs_kernel
def test_after_sleep_and_wake_up_it_gives_the_same_tokens(tmp_path) -> None:
    """Sleep frees the weights and the cache and wake_up reallocates them: the table follows."""
    rt = runtime(checkpoint(tmp_path / "ck"), enable_sleep_mode=True)
    try:
        before = LocalDriver(rt).run(REQUESTS, keep_logits=True)
        controls = RuntimeControls(rt)
        controls.handle("sleep", {"level": 1})
        controls.handle("wake_up", {})
        assert rt.decode_layers is not None
        assert_same(LocalDriver(rt).run(REQUESTS, keep_logits=True), before)
    finally:
        rt.close()


@needs_kernel
def test_addresses_are_read_again_only_after_a_control(tmp_path, monkeypatch) -> None:
    """Reading every weight's and cache's address costs tens of microseconds a step on a small
    model: steady steps reuse the table; after a sleep and wake-up (which move the tensors) the
    next step reads them again and gives the same bits, and so it does after a control that fails."""
    rt = runtime(checkpoint(tmp_path / "ck"), enable_sleep_mode=True)
    reads = []
    real = decode_layers.DecodeLayers._addresses
    monkeypatch.setattr(decode_layers.DecodeLayers, "_addresses", lambda self: reads.append(1) or real(self))
    try:
        before = LocalDriver(rt).run(REQUESTS, keep_logits=True)
        assert reads == []  # warm-up's step read them
        controls = RuntimeControls(rt)
        controls.handle("sleep", {"level": 1})
        controls.handle("wake_up", {})
        assert rt.decode_layers._moved  # else the next step would run on the freed addresses
        assert_same(LocalDriver(rt).run(REQUESTS, keep_logits=True), before)
        assert reads == [1]
        with pytest.raises(ValueError, match="unknown control"):
            controls.handle("no_such_control", {})
        LocalDriver(rt).run(REQUESTS[:1])
        assert reads == [1, 1]
    finally:
        rt.close()


@needs_kernel
def test_the_step_buffers_are_one_set_sized_for_the_widest_step(tmp_path, monkeypatch) -> None:
    """Steps of 1, then 3, then 1 row: every row count's buffers are views of one set (the memory of
    the widest step, not one set per row count), and each run gives the layer-by-layer bits."""
    path = checkpoint(tmp_path / "ck")
    rt = runtime(path)
    try:
        runs = [LocalDriver(rt).run(batch, keep_logits=True) for batch in (REQUESTS[:1], REQUESTS, REQUESTS[:1])]
        layers = rt.decode_layers
        widest = layers._widest
        assert widest[0].shape[0] >= 3
        assert 1 in layers._step_buffers and len(layers._step_buffers) > 1
        assert all(b.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                   for bufs in layers._step_buffers.values() for b, w in zip(bufs, widest))
    finally:
        rt.close()
    assert_same(runs[0], runs[2])
    assert_same(runs[1], layer_by_layer(monkeypatch, path))
