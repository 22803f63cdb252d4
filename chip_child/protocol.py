"""The wire between the L3 parent and a chip-child: msgpack arrays, validated before use.

A steady decode command is `[0, step, [], b""]` (6 to 10 bytes as the step grows): the finished rows and new
(row, block index, page id) triples are the only things that ever change. Token ids, page
triples and chunks travel as raw int32 bytes, never as per-element lists.

A step with admissions or prompt chunks is `[1, step, finished_rows, triples, admits, chunks]`.
An admit sets a row up: `[row, *per-row fields]` in the order of chip_child.step.row_fields.ROW_FIELDS,
token ids as int32 bytes; the row and the required fields alone are an admit that uses none of
the optional sampling features. Chunks are int32 bytes of (row, start, length,
staging_offset, last) quintuples: positions [start, start + length) of the row's sequence, ids at
staging_offset in the step's staging slot; the last chunk of a prompt samples the row's next token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import numpy as np

from chip_child.config import Limits
from chip_child.step.row_fields import (BASIC_FIELDS, FULL_STATE_FIELDS, MAX_GRAMMAR_BYTES, ROW_FIELDS, Admit, FullState,
                                   RowField)

OP_DECODE, OP_PREFILL, OP_SHUTDOWN, OP_CONTROL, OP_COPIES, OP_LORA = 0, 1, 2, 3, 4, 5
# Before a command, the prefix cache's host-tier copies: [4, (kind, page, slot) int32 bytes], kind 0
# a store (device page -> host slot), 1 a load (host slot -> device page), applied in order.
# Between steps, with no step in flight: [3, name, {args}] -> {"control": name, ...results}
# (chip_child.step.controls), or {"control": name, "refused": why} for input it cannot take.
CONTROLS = ("sleep", "wake_up", "update_weights", "drop_pending_weights")
MAX_STEP = 2**62  # step numbers stay well inside int64 wherever they are stored

_NO_PAGES = np.zeros((0, 3), np.int32)
_NO_PAGES.flags.writeable = False


class ProtocolError(ValueError):
    """A command that is malformed or names something outside the runtime's limits."""


@dataclass
class Chunk:
    """Positions [start, start + length) of `row`'s sequence, whose ids sit at `staging_offset`
    in the step's staging slot. The last chunk of a prefill samples the row's next token."""

    row: int
    start: int
    length: int
    staging_offset: int
    last: bool


@dataclass
class Command:
    """One step, applied in this order: rows leave, rows are set up, pages are assigned, then one
    forward runs over every active row's next token and every chunk."""

    step: int
    finished_rows: list[int] = field(default_factory=list)
    new_pages: np.ndarray = field(default_factory=lambda: _NO_PAGES)  # (row, block, page) int32
    admits: list[Admit] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    full_state: FullState | None = None

    @property
    def is_prefill(self) -> bool:
        return bool(self.chunks)


def prefill_command(step: int, prompts: list[tuple[Admit, np.ndarray, int]],
                    finished_rows: list[int] | None = None) -> Command:
    """A step that admits each (admit, page ids, staging offset) and prefills its whole prompt
    (admit.prompt_len ids at that offset) in one chunk: what in-process drivers send."""
    triples = [(a.row, block, int(page)) for a, pages, _ in prompts for block, page in enumerate(pages)]
    return Command(step, list(finished_rows or []), np.array(triples, np.int32).reshape(-1, 3),
                   [a for a, _, _ in prompts], [Chunk(a.row, 0, a.prompt_len, offset, True) for a, _, offset in prompts])


@dataclass
class Shutdown:
    pass


@dataclass
class Copies:
    """Page copies between the KV cache and its host tier (l3worker/engine/host_tier.py)."""

    copies: np.ndarray  # (kind, page, slot) int32 rows


@dataclass
class LoraLoad:
    """Before a command whose rows use it: adapter slot `slot` takes the adapter in the file `path`
    (written by l3worker.lora.registry in shared memory)."""

    slot: int
    path: str


@dataclass
class Control:
    """Sleep, wake or new weights: run between steps (the parent sends none meanwhile)."""

    name: str
    args: dict = field(default_factory=dict)


def encode(cmd: Command | Shutdown | Control | Copies | LoraLoad) -> bytes:
    if isinstance(cmd, Shutdown):
        return msgpack.packb([OP_SHUTDOWN])
    if isinstance(cmd, Control):
        return msgpack.packb([OP_CONTROL, cmd.name, cmd.args])
    if isinstance(cmd, Copies):
        return msgpack.packb([OP_COPIES, np.ascontiguousarray(cmd.copies, np.int32).tobytes()])
    if isinstance(cmd, LoraLoad):
        return msgpack.packb([OP_LORA, cmd.slot, cmd.path])
    pages = cmd.new_pages.astype(np.int32, copy=False).tobytes()
    if cmd.admits or cmd.chunks:
        admits = [[a.row, *(_to_wire(f, getattr(a, f.name)) for f in ROW_FIELDS)] for a in cmd.admits]
        chunks = np.array([(c.row, c.start, c.length, c.staging_offset, int(c.last)) for c in cmd.chunks],
                          np.int32).tobytes()
        return msgpack.packb([OP_PREFILL, cmd.step, cmd.finished_rows, pages, admits, chunks])
    body = [OP_DECODE, cmd.step, cmd.finished_rows, pages]
    if cmd.full_state is not None:
        fs = cmd.full_state
        # Positions and slots left to the device (speculation) travel as empty blobs.
        body.append([b"" if getattr(fs, n) is None else np.ascontiguousarray(getattr(fs, n), dtype=t).tobytes()
                     for n, t in FullState._FIELDS])
    return msgpack.packb(body)


def _to_wire(f: RowField, value: object) -> object:
    return np.asarray(value, np.int32).tobytes() if f.kind == "ids" else f.coerce(value)  # bytes as they are


def _int_array(raw: object, what: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise ProtocolError(f"{what}: expected int32 bytes")
    return np.frombuffer(raw, dtype=np.int32)


def _check_row(row: object, limits: Limits, what: str) -> int:
    if not isinstance(row, int) or not 0 <= row < limits.max_batch_size:
        raise ProtocolError(f"{what}: row {row!r} outside [0, {limits.max_batch_size})")
    return row


def _check_pages(pages: np.ndarray, limits: Limits, what: str) -> None:
    # Page 0 is the scratch page; no request may be given it.
    if pages.size and (pages.min() < 1 or pages.max() >= limits.num_pages):
        raise ProtocolError(f"{what}: page id outside [1, {limits.num_pages})")


def decode(raw: bytes, limits: Limits) -> Command | Shutdown | Control | Copies | LoraLoad:
    """Parses and range-checks a command; raises ProtocolError before anything is applied."""
    try:
        return _decode(raw, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # a field of the wrong type deep inside: still the sender's error
        raise ProtocolError(f"malformed command: {type(exc).__name__}: {exc}") from None


def _decode(raw: bytes, limits: Limits) -> Command | Shutdown | Control | Copies:
    try:
        msg = msgpack.unpackb(raw)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable command: {exc}") from None
    # The steady decode command, [0, step, [], b""], has nothing to check but its step: it takes
    # the fewest instructions, since it arrives every step and in a child its code runs cold.
    if type(msg) is list and len(msg) == 4 and msg[0] == OP_DECODE and msg[2] == [] and msg[3] == b"" \
            and type(msg[1]) is int and 0 <= msg[1] < MAX_STEP:
        return Command(msg[1])
    if not isinstance(msg, list) or not msg or msg[0] not in (OP_DECODE, OP_PREFILL, OP_SHUTDOWN, OP_CONTROL, OP_COPIES,
                                                               OP_LORA):
        raise ProtocolError(f"unknown op in command {msg!r:.80}")
    if msg[0] == OP_SHUTDOWN:
        return Shutdown()
    if msg[0] == OP_COPIES:
        if len(msg) != 2:
            raise ProtocolError("copies are [4, (kind, page, slot) int32 bytes]")
        copies = _int_array(msg[1], "copies")
        if copies.size % 3 or not limits.host_pages:
            raise ProtocolError("copies: not (kind, page, slot) triples, or no host tier")
        copies = copies.reshape(-1, 3)
        if ((copies[:, 0] < 0) | (copies[:, 0] > 1)).any():
            raise ProtocolError("copies: kind must be 0 (store) or 1 (load)")
        _check_pages(copies[:, 1], limits, "copies")
        if copies[:, 2].min() < 0 or copies[:, 2].max() >= limits.host_pages:
            raise ProtocolError(f"copies: host slot outside [0, {limits.host_pages})")
        return Copies(copies)
    if msg[0] == OP_LORA:
        if len(msg) != 3 or not isinstance(msg[1], int) or not 0 <= msg[1] < limits.max_loras \
                or not isinstance(msg[2], str):
            raise ProtocolError(f"a LoRA load is [5, slot in [0, {limits.max_loras}), path]")
        return LoraLoad(msg[1], msg[2])
    if msg[0] == OP_CONTROL:
        if len(msg) != 3 or msg[1] not in CONTROLS or not isinstance(msg[2], dict):
            raise ProtocolError(f"a control is [3, name, {{args}}] with name one of {CONTROLS}")
        return Control(msg[1], msg[2])
    if len(msg) < 4 or not isinstance(msg[1], int) or not isinstance(msg[2], list):
        raise ProtocolError("command must be [op, step, finished_rows, new_pages, ...]")
    if not 0 <= msg[1] < MAX_STEP:
        raise ProtocolError(f"step {msg[1]} outside [0, {MAX_STEP})")
    finished = [_check_row(r, limits, "finished_rows") for r in msg[2]]
    cmd = Command(step=msg[1], finished_rows=finished)
    if msg[3] != b"":  # the steady state skips numpy entirely
        cmd.new_pages = _decode_triples(msg[3], limits)
    if msg[0] == OP_PREFILL:
        if len(msg) != 6 or not isinstance(msg[4], list):
            raise ProtocolError("a prefill command is [1, step, finished_rows, new_pages, admits, chunks]")
        cmd.admits = [_decode_admit(a, limits) for a in msg[4]]
        if len({a.row for a in cmd.admits}) != len(cmd.admits):
            raise ProtocolError("admits: a row appears twice")
        cmd.chunks = _decode_chunks(msg[5], limits)
        if not cmd.admits and not cmd.chunks:
            raise ProtocolError("prefill command without admits or chunks")
    elif len(msg) > 4:
        cmd.full_state = _decode_full_state(msg[4], limits)
    return cmd


def _decode_triples(raw: object, limits: Limits) -> np.ndarray:
    triples = _int_array(raw, "new_pages")
    if triples.size % 3:
        raise ProtocolError("new_pages: length is not a multiple of 3")
    triples = triples.reshape(-1, 3)
    for row in triples[:, 0].tolist():
        _check_row(row, limits, "new_pages")
    if triples[:, 1].min() < 0 or triples[:, 1].max() >= limits.max_blocks_per_row:
        raise ProtocolError(f"new_pages: block index outside [0, {limits.max_blocks_per_row})")
    _check_pages(triples[:, 2], limits, "new_pages")
    return triples


def _decode_chunks(raw: object, limits: Limits) -> list[Chunk]:
    quints = _int_array(raw, "chunks")
    if quints.size % 5:
        raise ProtocolError("chunks: length is not a multiple of 5")
    chunks = []
    total = 0
    for row, start, length, offset, last in quints.reshape(-1, 5).tolist():
        _check_row(row, limits, "chunk")
        if not (0 <= start and 1 <= length and start + length <= limits.max_seq_len):
            raise ProtocolError(f"chunk: positions [{start}, {start + length}) outside [0, {limits.max_seq_len})")
        if not 0 <= offset <= limits.max_prefill_tokens - length:
            raise ProtocolError(f"chunk: staging range outside [0, {limits.max_prefill_tokens})")
        if last not in (0, 1):
            raise ProtocolError(f"chunk: last must be 0 or 1, got {last}")
        total += length
        chunks.append(Chunk(row, start, length, offset, bool(last)))
    if len({c.row for c in chunks}) != len(chunks):
        raise ProtocolError("chunks: a row appears twice")
    if total > limits.max_prefill_tokens:
        raise ProtocolError(f"chunks: more than max_prefill_tokens={limits.max_prefill_tokens} tokens")
    return chunks


_ADMIT_NAMES = ("row", *(f.name for f in ROW_FIELDS))
_ADMIT_BASIC = 1 + len(BASIC_FIELDS)
_ADMIT_NEUTRAL = [_to_wire(f, f.neutral) for f in ROW_FIELDS[len(BASIC_FIELDS):]]  # an admit without options


def _decode_admit(raw: object, limits: Limits) -> Admit:
    if not isinstance(raw, list) or len(raw) not in (_ADMIT_BASIC, len(_ADMIT_NAMES)):
        raise ProtocolError(f"admit must be [{', '.join(_ADMIT_NAMES)}] or its first {_ADMIT_BASIC} fields")
    if len(raw) == _ADMIT_BASIC:
        raw = raw + _ADMIT_NEUTRAL
    row = _check_row(raw[0], limits, "admit")
    return Admit(row, *(_check_admit_value(f, value, limits) for f, value in zip(ROW_FIELDS, raw[1:])))


def _check_admit_value(f: RowField, value: object, limits: Limits) -> object:
    """The wire value of one admit field, checked against its limits, as Admit holds it."""
    if f.kind == "ids":
        ids = _int_array(value, f"admit {f.name}")
        _check_token_ids(ids, limits, f"admit {f.name}")
        return ids
    if f.kind == "bytes":
        if not isinstance(value, bytes) or len(value) > MAX_GRAMMAR_BYTES:
            raise ProtocolError(f"admit: {f.name} must be bytes, at most {MAX_GRAMMAR_BYTES}")
        return value
    if f.kind == "int" and not _is_int(value):
        raise ProtocolError(f"admit: {f.name} {value!r} is not an int")
    if f.kind == "float" and not (_is_number(value) and math.isfinite(value)):
        raise ProtocolError(f"admit: {f.name} {value!r} is not a finite number")
    if not f.contains(value, limits):
        raise ProtocolError(f"admit: {f.name} {value!r} outside {f.interval(limits)}")
    return f.coerce(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: np.ndarray, limits: Limits, what: str, allow_pad: bool = False) -> None:
    low = -1 if allow_pad else 0
    high = limits.vocab_size or 2**31
    if ids.size and (ids.min() < low or ids.max() >= high):
        raise ProtocolError(f"{what}: token id outside [{low}, {limits.vocab_size or '2**31'})")


DEVICE_OWNED = ("positions", "slot_mapping")  # a full state may leave these to the device (empty blobs)


def _decode_full_state(raw: object, limits: Limits) -> FullState:
    if not isinstance(raw, list) or len(raw) != len(FullState._FIELDS):
        raise ProtocolError("full_state: wrong number of fields")
    b = limits.max_batch_size
    ids = {f.array for f in FULL_STATE_FIELDS if f.kind == "ids"}
    arrays = {}
    for blob, (name, dtype) in zip(raw, FullState._FIELDS):
        want = b * limits.max_blocks_per_row if name == "block_table" else b
        # A writable copy: torch refuses to wrap read-only memory without a warning.
        ok = isinstance(blob, bytes) and len(blob) % np.dtype(dtype).itemsize == 0
        arr = np.frombuffer(blob, dtype=dtype).copy() if ok else None
        if name in DEVICE_OWNED and blob == b"":  # left to the device (speculation)
            arrays[name] = None
            continue
        if name in ids:  # [B, S] for any S
            if arr is None or arr.size % b:
                raise ProtocolError(f"full_state.{name}: expected a multiple of {b} values of {np.dtype(dtype).name}")
            arr = arr.reshape(b, -1)
        elif arr is None or arr.size != want:
            raise ProtocolError(f"full_state.{name}: expected {want} values of {np.dtype(dtype).name}")
        arrays[name] = arr
    arrays["block_table"] = arrays["block_table"].reshape(b, limits.max_blocks_per_row)
    if arrays["active"].view(np.uint8).max() > 1:
        raise ProtocolError("full_state.active: values must be 0 or 1")
    positions, slots = arrays["positions"], arrays["slot_mapping"]
    if (positions is None) != (slots is None):
        raise ProtocolError("full_state: positions and slot_mapping go together, both given or both left out")
    if positions is not None and (positions.min() < 0 or positions.max() >= limits.max_seq_len):
        raise ProtocolError(f"full_state.positions: position outside [0, {limits.max_seq_len})")
    # Unassigned blocks hold 0 (the scratch page) in a full block table.
    if arrays["block_table"].min() < 0 or arrays["block_table"].max() >= limits.num_pages:
        raise ProtocolError(f"full_state.block_table: page id outside [0, {limits.num_pages})")
    if slots is not None and (slots.min() < 0 or slots.max() >= limits.num_pages * limits.page_size):
        raise ProtocolError("full_state.slot_mapping: slot outside the KV cache")
    for f in FULL_STATE_FIELDS:
        _check_full_state_array(f, arrays[f.array], limits)
    return FullState(**arrays)


def _check_full_state_array(f: RowField, values: np.ndarray, limits: Limits) -> None:
    """A per-row field's array: every row's value within the field's limits, or the neutral
    value (an idle row's). Arrays of keys (seed_keys) are the child's own values: any will do."""
    what = f"full_state.{f.array}"
    if f.kind == "ids":
        _check_token_ids(values, limits, what, allow_pad=True)
    elif f.key is None:
        if f.kind == "float" and not np.isfinite(values).all():
            raise ProtocolError(f"{what}: values must be finite")
        if not (f.contains(values, limits) | (values == f.neutral)).all():
            idle = "" if f.contains(f.neutral, limits) else f" or {f.neutral} (an idle row)"
            raise ProtocolError(f"{what}: values outside {f.interval(limits)}{idle}")


# Replies from the child: a wake-up is the bare step number; errors and the ready report are maps.
def encode_wakeup(step: int) -> bytes:
    return msgpack.packb(step)


def encode_error(step: int | None, message: str, traceback_text: str) -> bytes:
    return msgpack.packb({"error": message, "traceback": traceback_text, "step": step})
