"""Failure paths found in review: a failed step is never read past, bad sampling values are
refused up front, a child that cannot start leaves nothing behind, malformed commands are refused
whole."""
from __future__ import annotations

import os
import subprocess

import msgpack
import numpy as np
import pytest

from chip_child import protocol
from chip_child.protocol import Admit, Command, Limits
from l3worker import ChildError, DistributedWorker, SamplingParams

SMALL = dict(device="cpu", max_batch_size=2, max_seq_len=64, page_size=8)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_failed_prefill_raises_even_when_later_steps_run_ahead(depth) -> None:
    # The prefill fails; with run-ahead a decode step is already queued behind it. The child must
    # refuse it rather than complete it, or the parent would read stale ids as the prefill's.
    # No restarts: the error reaches the caller.
    w = DistributedWorker(None, pipeline_depth=depth, fault_injection="prefill:raise@0", max_restarts=0, **SMALL)
    with pytest.raises(ChildError, match="injected fault in prefill"):
        w.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert w.stats()["state"] == "closed"


def test_spin_wait_and_timeouts_are_bounded() -> None:
    for bad in (float("inf"), 1.0, -0.001):
        with pytest.raises(ValueError, match="spin_wait_s"):
            DistributedWorker(None, spin_wait_s=bad, **SMALL)
    for name in ("step_timeout_s", "startup_timeout_s"):
        with pytest.raises(ValueError, match=name):
            DistributedWorker(None, **{name: 0}, **SMALL)


def test_sampling_values_are_checked_before_anything_is_sent() -> None:
    with DistributedWorker(None, **SMALL) as w:
        good = w.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=np.float32(0.5), seed=3))
        bad = [SamplingParams(temperature=0.0, top_k=2**63), SamplingParams(temperature=0.0, top_k=10**6), SamplingParams(temperature=float("nan")),
               SamplingParams(temperature=float("inf")), SamplingParams(temperature="0.5"),
               SamplingParams(temperature=0.0, seed=2**63)]
        for params in bad:
            with pytest.raises((ValueError, TypeError), match="top_k|temperature|seed"):
                w.generate([[1, 2, 3]], params)
        with pytest.raises(ValueError, match="token id"):
            w.generate([[1, 2**64]])
        again = w.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.5, seed=3))
        assert again[0].token_ids == good[0].token_ids


def test_bad_constructor_types() -> None:
    import torch

    with pytest.raises(TypeError, match="dtype"):
        DistributedWorker(None, dtype=torch.float16, **SMALL)
    with pytest.raises(TypeError, match="num_threads"):
        DistributedWorker(None, num_threads=1.5, **SMALL)


def test_child_that_cannot_start_leaves_nothing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError("no more processes")

    w = DistributedWorker(None, **SMALL)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    with pytest.raises(OSError, match="no more processes"):
        w.prepare()
    assert w.socket_dir is None and w.child_pids == []


LIMITS = Limits(max_batch_size=4, max_blocks_per_row=4, num_pages=9, max_seq_len=32, max_prefill_tokens=64,
                page_size=8)


def _admit(**overrides) -> list:
    fields = dict(row=0, prompt_len=10, temperature=0.0, top_p=1.0, top_k=0, seed=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                  repetition_penalty=1.0, max_new_tokens=0, min_tokens=0, stop_ids=b"", logprobs=-1, prompt_logprobs=-1,
                  grammar=b"", grammar_after=-1, grammar_replay=b"", cached_ids=b"", lora_slot=-1)
    fields.update(overrides)
    return list(fields.values())


@pytest.mark.parametrize("admit, message", [
    (_admit(prompt_len=32), "prompt_len 32 outside"),
    (_admit(temperature="x"), "temperature"),
    (_admit(temperature=float("nan")), "temperature"),
    (_admit(top_k=2**40), "top_k"),
    (_admit(seed=None), "seed"),
    (_admit(seed=-1), "seed"),
    (_admit(min_p=2.0), "min_p"),
    (_admit(repetition_penalty=0), "repetition_penalty"),
    (_admit(stop_ids=b"\x01"), "stop_ids"),
    (_admit(logprobs=50), "logprobs"),
    (_admit(grammar="text"), "grammar"),
    (_admit(grammar_after=-2), "grammar_after"),
    (_admit(lora_slot=0), "lora_slot"),  # no adapter slots: max_loras=0
    (_admit()[:9], "admit must be"),
    (_admit()[:5], "admit must be"),
])
def test_malformed_admits_are_refused(admit, message) -> None:
    raw = msgpack.packb([protocol.OP_PREFILL, 0, [], b"", [admit], b""])
    with pytest.raises(protocol.ProtocolError, match=message) as refused:
        protocol.decode(raw, LIMITS)
    if message != "admit must be":  # refused for the field itself, not for the admit's length
        assert "admit must be" not in str(refused.value)


@pytest.mark.parametrize("raw, message", [
    (msgpack.packb([protocol.OP_PREFILL, 0, [], b"", 5, b""]), "admits"),
    (msgpack.packb([protocol.OP_PREFILL, 0, [], b"", [], [1, 2]]), "chunks: expected int32 bytes"),
    (msgpack.packb([protocol.OP_DECODE, -5, [], b""]), "step"),
    (msgpack.packb([protocol.OP_DECODE, 2**63 - 1, [], b""]), "step"),
    (msgpack.packb([protocol.OP_CONTROL, "format_disk", {}]), "name one of"),
    (msgpack.packb([protocol.OP_CONTROL, "sleep", [1]]), "a control is"),
])
def test_malformed_commands_are_refused(raw, message) -> None:
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.decode(raw, LIMITS)


def test_controls_round_trip() -> None:
    cmd = protocol.Control("update_weights", {"dir": "/dev/shm/x", "names": ["model.norm.weight"]})
    assert protocol.decode(protocol.encode(cmd), LIMITS) == cmd


def test_full_state_positions_and_flags_are_checked() -> None:
    b, mb = LIMITS.max_batch_size, LIMITS.max_blocks_per_row

    def state(**overrides) -> protocol.FullState:
        fields = dict(positions=np.zeros(b, np.int64), active=np.zeros(b, bool),
                      block_table=np.zeros((b, mb), np.int32), slot_mapping=np.zeros(b, np.int64),
                      temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32),
                      top_k=np.zeros(b, np.int64), seed_keys=np.zeros(b, np.int64))
        fields.update(overrides)
        return protocol.FullState(**fields)

    ok = protocol.encode(Command(step=1, full_state=state()))
    assert protocol.decode(ok, LIMITS).full_state is not None
    too_far = protocol.encode(Command(step=1, full_state=state(positions=np.full(b, 40, np.int64))))
    with pytest.raises(protocol.ProtocolError, match="positions"):
        protocol.decode(too_far, LIMITS)
    flags = msgpack.unpackb(ok)
    flags[4][1] = bytes([0, 2, 0, 7])
    with pytest.raises(protocol.ProtocolError, match="active"):
        protocol.decode(msgpack.packb(flags), LIMITS)
    # Speculating, positions and slots are left to the device: both out, never one alone.
    left = protocol.decode(protocol.encode(Command(step=1, full_state=state(positions=None, slot_mapping=None))),
                           LIMITS).full_state
    assert left.positions is None and left.slot_mapping is None and left.active.shape == (b,)
    half = msgpack.unpackb(ok)
    half[4][0] = b""
    with pytest.raises(protocol.ProtocolError, match="positions and slot_mapping go together"):
        protocol.decode(msgpack.packb(half), LIMITS)


def test_admit_round_trip_keeps_values() -> None:
    cmd = Command(step=3, admits=[Admit(1, 10, 0.5, 0.9, 7, 2**63 + 5)])
    back = protocol.decode(protocol.encode(cmd), LIMITS)
    a = back.admits[0]
    assert (a.row, a.prompt_len, a.temperature, a.top_p, a.top_k, a.seed) == (1, 10, 0.5, 0.9, 7, 2**63 + 5)
    assert os.environ.get("L3WORKER_CACHE")  # the session fixture keeps the tiny model out of $HOME
