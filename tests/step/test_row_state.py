"""The per-row field table, what derives from it, and RowState and ChunkLayout without a model."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from chip_child.step.chunk_layout import ChunkInts, ChunkLayout
from chip_child.config import Limits
from chip_child.protocol import Command, ProtocolError, decode, encode
from chip_child.step.row_fields import (BASIC_FIELDS, DEVICE_FIELDS, FULL_STATE_FIELDS, MAX_GRAMMAR_BYTES, ROW_FIELDS,
                                   SCALAR_FIELDS, Admit, FullState, example_values, row_values)
from chip_child.step.row_state import RowState
from l3worker.params import SamplingParams

VOCAB, BATCH, BLOCKS = 300, 4, 8
LIMITS = Limits(max_batch_size=BATCH, max_blocks_per_row=BLOCKS, num_pages=33, max_seq_len=32, max_prefill_tokens=64,
                page_size=4, vocab_size=VOCAB, max_loras=2)


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


def test_config_and_protocol_import_without_torch() -> None:
    code = ("import sys, chip_child.config, chip_child.protocol; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admit_fields_follow_the_table() -> None:
    assert [f.name for f in dataclasses.fields(Admit)] == ["row", *(f.name for f in ROW_FIELDS)]
    with pytest.raises(TypeError):  # the basic fields have no default
        Admit(0)
    plain = Admit(0, *(f.example for f in BASIC_FIELDS))
    for f in ROW_FIELDS[len(BASIC_FIELDS):]:
        assert _same(getattr(plain, f.name), f.neutral), f.name


def test_every_field_round_trips_the_admit_with_a_non_neutral_value() -> None:
    values = example_values()
    for f in ROW_FIELDS:
        assert not _same(values[f.name], f.neutral), f"{f.name}: its example must use the option"
        if f.kind != "ids":
            assert f.contains(values[f.name], LIMITS), f.name
    got = decode(encode(Command(step=0, admits=[Admit(2, **values)])), LIMITS).admits[0]
    assert got.row == 2
    for f in ROW_FIELDS:
        assert _same(getattr(got, f.name), values[f.name]), f.name


def test_every_full_state_field_round_trips_with_a_non_neutral_value() -> None:
    values = example_values()
    b = BATCH
    sent = FullState.from_rows(np.zeros(b, np.int64), np.zeros(b, bool), np.zeros((b, BLOCKS), np.int32),
                               np.zeros(b, np.int64), [(1, values)])
    got = decode(encode(Command(step=1, full_state=sent)), LIMITS).full_state
    assert [name for name, _ in FullState._FIELDS][4:] == [f.array for f in FULL_STATE_FIELDS]
    for f in FULL_STATE_FIELDS:
        arr = getattr(got, f.array)
        assert arr.dtype == f.dtype, f.name
        if f.kind == "ids":
            assert arr[1].tolist() == list(values[f.name]) and (arr[[0, 2, 3]] == -1).all(), f.name
        else:
            assert arr[1] == np.asarray(f.to_array(values[f.name]), f.dtype), f.name
            assert (arr[[0, 2, 3]] == f.neutral).all(), f.name  # the other rows: neutral


def _outside(f) -> list:
    """Values just outside a field's limits (that msgpack can carry)."""
    if f.kind == "bytes":
        return [b"x" * (MAX_GRAMMAR_BYTES + 1), "text"]
    low, high = f.bounds(LIMITS)
    step = 1 if f.kind == "int" else 0.5
    bad = []
    if low > -math.inf:
        bad.append(low - step if f.ends[0] == "[" else low)
    if high < math.inf:
        bad.append(high + step if f.ends[1] == "]" else high)
    if f.kind == "float":
        bad.append(float("nan"))
    return [v for v in bad if not (isinstance(v, int) and v >= 2**64)]


@pytest.mark.parametrize("f", [f for f in ROW_FIELDS if f.kind != "ids"], ids=lambda f: f.name)
def test_every_field_is_checked_against_its_limits(f) -> None:
    assert _outside(f)
    wire = msgpack.unpackb(encode(Command(step=0, admits=[Admit(1, **example_values())])))
    for value in _outside(f):
        admit = list(wire[4][0])
        admit[1 + ROW_FIELDS.index(f)] = value
        with pytest.raises(ProtocolError, match=f"admit: {f.name} "):
            decode(msgpack.packb([*wire[:4], [admit], wire[5]]), LIMITS)
        if f.full_state and f.key is None and value != f.neutral:  # an idle row holds the neutral value
            b = BATCH
            fs = FullState(np.zeros(b, np.int64), np.zeros(b, bool), np.zeros((b, BLOCKS), np.int32),
                           np.zeros(b, np.int64), **{f.array: np.full(b, value, f.dtype)})
            with pytest.raises(ProtocolError, match=f"full_state.{f.array}"):
                decode(encode(Command(step=1, full_state=fs)), LIMITS)


def test_row_values_take_the_source_then_neutral_values() -> None:
    params = SamplingParams(temperature=0.5, top_k=3)
    no_grammar = {"grammar": None, "grammar_after": None, "grammar_replay": None, "cached_ids": None,
                  "lora_slot": None}
    values = row_values(params, prompt_len=4, seed=9, stop_ids=[2, 1], prompt_logprobs=None, **no_grammar)
    assert values["temperature"] == 0.5 and values["top_k"] == 3 and values["logprobs"] == -1
    assert values["grammar"] == b"" and values["grammar_after"] == -1 and values["grammar_replay"].size == 0
    assert values["prompt_logprobs"] == -1 and values["stop_ids"].tolist() == [2, 1]
    assert values["cached_ids"].size == 0 and values["max_new_tokens"] == params.max_new_tokens
    assert values["lora_slot"] == -1
    assert all(type(values[f.name]) is (float if f.kind == "float" else int) for f in SCALAR_FIELDS)
    with pytest.raises(AttributeError):
        row_values(params, prompt_len=4, seed=9)  # stop_ids: the caller decides them (eos, stop_token_ids)
    with pytest.raises(TypeError, match="not per-row fields"):
        row_values(params, prompt_len=4, seed=1, stop_ids=[], prompt_logprobs=None, top_kk=3, **no_grammar)


# -- RowState --------------------------------------------------------------------------------------

def _counting_rows() -> tuple[RowState, list[np.ndarray]]:
    rows = RowState.allocate(BATCH, VOCAB, BLOCKS)
    copies: list[np.ndarray] = []
    h2d = rows._h2d
    rows._h2d = lambda arr: copies.append(arr) or h2d(arr)
    return rows, copies


def _admit(row: int, **changes) -> Admit:
    return Admit(row, **{**example_values(), "prompt_len": 5, **changes})


def test_set_up_writes_every_field_to_the_device_and_the_host_copies() -> None:
    rows, copies = _counting_rows()
    admits = [_admit(1), Admit(3, 4, 0.0, 1.0, 0, 0)]
    rows.set_up(admits)
    for a in admits:
        for f in DEVICE_FIELDS:
            want = np.asarray(f.to_array(getattr(a, f.name)), f.dtype)
            assert rows.state[f.array][a.row].item() == want, f.name
        for f in SCALAR_FIELDS:
            assert rows.host[f.array][a.row] == np.asarray(f.to_array(getattr(a, f.name)), f.dtype), f.name
    assert rows.state["min_pos"].tolist() == [0, 5 - 1 + 2, 0, 0]
    assert rows.state["stop_mask"][1].nonzero().flatten().tolist() == [0] and not rows.state["stop_mask"][3].any()
    assert rows.penalized.tolist() == [False, True, False, False]
    assert not rows.active.any() and not rows.state["active"].any()
    # Rows, one copy per dtype of the fields, the stop ids: not one per field.
    assert len(copies) == 4
    copies.clear()
    rows.set_up([Admit(0, 4, 0.0, 1.0, 0, 0)])
    assert len(copies) == 3


def test_facts_follow_admission_decoding_and_finish() -> None:
    rows = RowState.allocate(BATCH, VOCAB, BLOCKS)
    rows.set_up([_admit(1), Admit(0, 4, 0.0, 1.0, 0, 0)])
    assert not rows.facts().any_active  # set up, not decoding yet
    rows.start_decoding([0, 1], [3, 4])
    facts = rows.facts()
    assert (facts.furthest, facts.any_random, facts.any_filter, facts.any_penalty, facts.any_min_p) == \
        (4, True, True, True, True)
    assert facts.logprobs == ROW_FIELDS[[f.name for f in ROW_FIELDS].index("logprobs")].example
    assert facts.mask_steps == (5 - 1 + 2) - 4 and facts.lanes == 2 and not facts.plain
    rows.advance()
    assert rows.positions.tolist() == [4, 5, 0, 0] and rows.facts() is facts and facts.furthest == 5
    rows.finish([1])
    facts = rows.facts()
    assert (facts.furthest, facts.any_random, facts.any_penalty, facts.lanes, facts.plain) == (4, False, False, 1, True)
    assert rows.state["active"].tolist() == [False] * 4  # the device learns of decoding rows from the step


def test_a_full_state_loads_what_admission_sets_up() -> None:
    admitted = RowState.allocate(BATCH, VOCAB, BLOCKS)
    admits = [_admit(1), Admit(2, 4, 0.7, 0.5, 3, 11, repetition_penalty=1.5)]
    admitted.set_up(admits)
    admitted.start_decoding([1, 2], [4, 3])
    loaded = RowState.allocate(BATCH, VOCAB, BLOCKS)
    fs = FullState.from_rows(admitted.positions.copy(), admitted.active.copy(), np.zeros((BATCH, BLOCKS), np.int32),
                             np.zeros(BATCH, np.int64),
                             [(a.row, {f.name: getattr(a, f.name) for f in ROW_FIELDS}) for a in admits])
    loaded.load_full_state(fs)
    for name in (*(f.array for f in DEVICE_FIELDS), "min_pos", "stop_mask"):
        assert torch.equal(loaded.state[name], admitted.state[name]), name
    for f in FULL_STATE_FIELDS:
        if f.kind != "ids":
            assert _same(loaded.host[f.array], admitted.host[f.array]), f.name
    assert _same(loaded.penalized, admitted.penalized) and _same(loaded.min_pos, admitted.min_pos)
    # A grammar is the child's own state from admission (like the output counts): no full state carries it.
    assert admitted.facts().any_grammar and not loaded.facts().any_grammar
    assert dataclasses.asdict(loaded.facts()) == {**dataclasses.asdict(admitted.facts()), "any_grammar": False}


# -- ChunkLayout -------------------------------------------------------------------------------------

def test_chunk_layout_unpacks_what_it_packs() -> None:
    layout = ChunkLayout(tokens=5, chunks=2, lanes=3, last=1)
    sizes = dict(ids=5, positions=5, rows=5, query_starts=6, seq_lens=2, seq_rows=5, last_rows=1, last_index=1,
                 targets=3)
    at, parts = 0, {}
    for name, size in sizes.items():
        parts[name] = np.arange(at, at + size)
        at += size
    ints = layout.pack(ChunkInts(**parts))
    assert len(ints) == at and ints.dtype == np.int64
    got = layout.unpack(torch.from_numpy(np.concatenate([ints, [-7, -7]])))  # the pooled buffer runs on
    for name, part in parts.items():
        want = list(part) + ([-7, -7] if name == "targets" else [])
        assert getattr(got, name).tolist() == want, name
    with pytest.raises(ValueError, match="seq_lens has 3 values, the layout 2"):
        layout.pack(ChunkInts(**{**parts, "seq_lens": np.arange(3)}))
