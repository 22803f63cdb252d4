"""The wire between the L3 parent and a chip-child: msgpack arrays, validated before use.

A steady decode command is `[0, step, [], b""]` (6 to 10 bytes as the step grows): the finished rows and new
(row, block index, page id) triples are the only things that ever change. Token ids, page
triples and chunks travel as raw int32 bytes, never as per-element lists.

A step with admissions or prompt chunks is `[1, step, finished_rows, triples, admits, chunks]`.
An admit sets a row up: `[row, prompt_len, temperature, top_p, top_k, seed, min_p,
presence_penalty, frequency_penalty, repetition_penalty, min_tokens, stop_ids, logprobs,
prompt_logprobs]`, stop_ids as int32 bytes; its first six fields alone are an admit that uses
none of the optional sampling features. Chunks are int32 bytes of (row, start, length,
staging_offset, last) quintuples: positions [start, start + length) of the row's sequence, ids at
staging_offset in the step's staging slot; the last chunk of a prompt samples the row's next token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import msgpack
import numpy as np

OP_DECODE, OP_PREFILL, OP_SHUTDOWN = 0, 1, 2
MAX_STEP = 2**62  # step numbers stay well inside int64 wherever they are stored
MAX_LOGPROBS = 20  # top-N log-probabilities per token; l3worker.params.MAX_LOGPROBS (a test keeps them equal)


_NO_PAGES = np.zeros((0, 3), np.int32)
_NO_PAGES.flags.writeable = False
_NO_IDS = np.zeros(0, np.int32)
_NO_IDS.flags.writeable = False


class ProtocolError(ValueError):
    """A command that is malformed or names something outside the runtime's limits."""


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_blocks_per_row: int
    num_pages: int
    max_seq_len: int
    max_prefill_tokens: int
    page_size: int
    vocab_size: int = 0  # 0: unknown, token ids are only checked to be non-negative


@dataclass
class Admit:
    """A sequence taking `row`: its sampling parameters. Its pages arrive as triples and its
    prompt as chunks, in this command and later ones; the row decodes once its last chunk ran.
    Generated tokens start at `prompt_len` (a resumed sequence prefills some of them again): the
    last chunk's sampled token is generated token (its end - prompt_len), and a decode step
    whose input sits at position p samples generated token p - prompt_len + 1. While that index is
    below `min_tokens` the `stop_ids` (eos and stop token ids, as the parent decides) cannot be
    sampled. Penalties, min_p and log-probabilities follow l3worker.params.SamplingParams; the
    penalties count the row's chunk tokens (prompt below prompt_len, output from there), so a
    penalized sequence's chunks must cover it from position 0. `logprobs` and `prompt_logprobs`
    are -1 for none, else the number of top entries (0..MAX_LOGPROBS)."""

    row: int
    prompt_len: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int32
    logprobs: int = -1
    prompt_logprobs: int = -1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


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
class FullState:
    """copy_policy="always": every decode input the parent owns, rebuilt and sent each step.

    The sampling parameters of Admit are re-sent too (the output token counts are not: like the
    KV cache they are state the device builds). Fields left None get the values of a row that
    uses none of those features, so a sender that knows only the first eight fields still works."""

    positions: np.ndarray  # int64 [B]
    active: np.ndarray  # bool [B]
    block_table: np.ndarray  # int32 [B, max_blocks]
    slot_mapping: np.ndarray  # int64 [B]
    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int64 [B]
    seed_keys: np.ndarray  # int64 [B]
    min_p: np.ndarray | None = None  # float32 [B]
    presence_penalty: np.ndarray | None = None  # float32 [B]
    frequency_penalty: np.ndarray | None = None  # float32 [B]
    repetition_penalty: np.ndarray | None = None  # float32 [B]
    min_tokens: np.ndarray | None = None  # int64 [B]
    prompt_lens: np.ndarray | None = None  # int64 [B] (min_tokens counts from the prompt's end)
    logprobs: np.ndarray | None = None  # int64 [B], -1: none
    stop_ids: np.ndarray | None = None  # int32 [B, S], each row's stop ids padded with -1

    _FIELDS = (("positions", np.int64), ("active", np.bool_), ("block_table", np.int32),
               ("slot_mapping", np.int64), ("temperature", np.float32), ("top_p", np.float32),
               ("top_k", np.int64), ("seed_keys", np.int64), ("min_p", np.float32),
               ("presence_penalty", np.float32), ("frequency_penalty", np.float32),
               ("repetition_penalty", np.float32), ("min_tokens", np.int64), ("prompt_lens", np.int64),
               ("logprobs", np.int64), ("stop_ids", np.int32))
    _NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "min_tokens": 0, "prompt_lens": 0, "logprobs": -1}

    def __post_init__(self) -> None:
        b = len(self.positions)
        dtypes = dict(self._FIELDS)
        for name, value in self._NEUTRAL.items():
            if getattr(self, name) is None:
                setattr(self, name, np.full(b, value, dtypes[name]))
        if self.stop_ids is None:
            self.stop_ids = np.zeros((b, 0), np.int32)


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


def encode(cmd: Command | Shutdown) -> bytes:
    if isinstance(cmd, Shutdown):
        return msgpack.packb([OP_SHUTDOWN])
    pages = cmd.new_pages.astype(np.int32, copy=False).tobytes()
    if cmd.admits or cmd.chunks:
        admits = [[a.row, a.prompt_len, a.temperature, a.top_p, a.top_k, a.seed, float(a.min_p),
                   float(a.presence_penalty), float(a.frequency_penalty), float(a.repetition_penalty),
                   int(a.min_tokens), np.asarray(a.stop_ids, np.int32).tobytes(), int(a.logprobs),
                   int(a.prompt_logprobs)] for a in cmd.admits]
        chunks = np.array([(c.row, c.start, c.length, c.staging_offset, int(c.last)) for c in cmd.chunks],
                          np.int32).tobytes()
        return msgpack.packb([OP_PREFILL, cmd.step, cmd.finished_rows, pages, admits, chunks])
    body = [OP_DECODE, cmd.step, cmd.finished_rows, pages]
    if cmd.full_state is not None:
        fs = cmd.full_state
        body.append([np.ascontiguousarray(getattr(fs, n), dtype=t).tobytes() for n, t in FullState._FIELDS])
    return msgpack.packb(body)


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


def decode(raw: bytes, limits: Limits) -> Command | Shutdown:
    """Parses and range-checks a command; raises ProtocolError before anything is applied."""
    try:
        return _decode(raw, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # a field of the wrong type deep inside: still the sender's error
        raise ProtocolError(f"malformed command: {type(exc).__name__}: {exc}") from None


def _decode(raw: bytes, limits: Limits) -> Command | Shutdown:
    try:
        msg = msgpack.unpackb(raw)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable command: {exc}") from None
    # The steady decode command, [0, step, [], b""], has nothing to check but its step: it takes
    # the fewest instructions, since it arrives every step and in a child its code runs cold.
    if type(msg) is list and len(msg) == 4 and msg[0] == OP_DECODE and msg[2] == [] and msg[3] == b"" \
            and type(msg[1]) is int and 0 <= msg[1] < MAX_STEP:
        return Command(msg[1])
    if not isinstance(msg, list) or not msg or msg[0] not in (OP_DECODE, OP_PREFILL, OP_SHUTDOWN):
        raise ProtocolError(f"unknown op in command {msg!r:.80}")
    if msg[0] == OP_SHUTDOWN:
        return Shutdown()
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


_ADMIT_FIELDS = tuple(f.name for f in fields(Admit))
_ADMIT_BASIC = 6  # row .. seed
_ADMIT_NEUTRAL = [0.0, 0.0, 0.0, 1.0, 0, b"", -1, -1]  # min_p .. prompt_logprobs of an admit without them


def _decode_admit(raw: object, limits: Limits) -> Admit:
    if not isinstance(raw, list) or len(raw) not in (_ADMIT_BASIC, len(_ADMIT_FIELDS)):
        raise ProtocolError(f"admit must be [{', '.join(_ADMIT_FIELDS)}] or its first {_ADMIT_BASIC} fields")
    if len(raw) == _ADMIT_BASIC:
        raw = raw + _ADMIT_NEUTRAL
    (row, plen, temperature, top_p, top_k, seed, min_p, presence, frequency, repetition,
     min_tokens, stop_ids, logprobs, prompt_logprobs) = raw
    _check_row(row, limits, "admit")
    if not _is_int(plen) or not 1 <= plen < limits.max_seq_len:
        raise ProtocolError(f"admit: prompt_len {plen!r} outside [1, {limits.max_seq_len})")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(f"admit: {name} {value!r} is not a finite number")
    if not isinstance(top_k, int) or not 0 <= top_k < 2**31:
        raise ProtocolError(f"admit: top_k {top_k!r} outside [0, 2**31)")
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ProtocolError(f"admit: seed {seed!r} outside [0, 2**64)")
    for name, value in (("min_p", min_p), ("presence_penalty", presence), ("frequency_penalty", frequency),
                        ("repetition_penalty", repetition)):
        if not _is_number(value) or not math.isfinite(value):
            raise ProtocolError(f"admit: {name} {value!r} is not a finite number")
    if not 0 <= min_p <= 1:
        raise ProtocolError(f"admit: min_p {min_p!r} outside [0, 1]")
    if not repetition > 0:
        raise ProtocolError(f"admit: repetition_penalty {repetition!r} must be > 0")
    if not _is_int(min_tokens) or not 0 <= min_tokens <= limits.max_seq_len:
        raise ProtocolError(f"admit: min_tokens {min_tokens!r} outside [0, {limits.max_seq_len}]")
    stop_ids = _int_array(stop_ids, "admit stop_ids")
    _check_token_ids(stop_ids, limits, "admit stop_ids")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if not _is_int(value) or not -1 <= value <= MAX_LOGPROBS:
            raise ProtocolError(f"admit: {name} {value!r} outside [-1, {MAX_LOGPROBS}]")
    return Admit(row, plen, float(temperature), float(top_p), top_k, seed, float(min_p), float(presence),
                 float(frequency), float(repetition), min_tokens, stop_ids, logprobs, prompt_logprobs)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: np.ndarray, limits: Limits, what: str, allow_pad: bool = False) -> None:
    low = -1 if allow_pad else 0
    high = limits.vocab_size or 2**31
    if ids.size and (ids.min() < low or ids.max() >= high):
        raise ProtocolError(f"{what}: token id outside [{low}, {limits.vocab_size or '2**31'})")


def _decode_full_state(raw: object, limits: Limits) -> FullState:
    if not isinstance(raw, list) or len(raw) != len(FullState._FIELDS):
        raise ProtocolError("full_state: wrong number of fields")
    b = limits.max_batch_size
    arrays = {}
    for blob, (name, dtype) in zip(raw, FullState._FIELDS):
        want = b * limits.max_blocks_per_row if name == "block_table" else b
        # A writable copy: torch refuses to wrap read-only memory without a warning.
        ok = isinstance(blob, bytes) and len(blob) % np.dtype(dtype).itemsize == 0
        arr = np.frombuffer(blob, dtype=dtype).copy() if ok else None
        if name == "stop_ids":  # [B, S] for any S
            if arr is None or arr.size % b:
                raise ProtocolError(f"full_state.stop_ids: expected a multiple of {b} values of int32")
        elif arr is None or arr.size != want:
            raise ProtocolError(f"full_state.{name}: expected {want} values of {np.dtype(dtype).name}")
        arrays[name] = arr
    arrays["block_table"] = arrays["block_table"].reshape(b, limits.max_blocks_per_row)
    arrays["stop_ids"] = arrays["stop_ids"].reshape(b, -1)
    if arrays["active"].view(np.uint8).max() > 1:
        raise ProtocolError("full_state.active: values must be 0 or 1")
    positions = arrays["positions"]
    if positions.min() < 0 or positions.max() >= limits.max_seq_len:
        raise ProtocolError(f"full_state.positions: position outside [0, {limits.max_seq_len})")
    # Unassigned blocks hold 0 (the scratch page) in a full block table.
    if arrays["block_table"].min() < 0 or arrays["block_table"].max() >= limits.num_pages:
        raise ProtocolError(f"full_state.block_table: page id outside [0, {limits.num_pages})")
    slots = arrays["slot_mapping"]
    if slots.min() < 0 or slots.max() >= limits.num_pages * limits.page_size:
        raise ProtocolError("full_state.slot_mapping: slot outside the KV cache")
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not np.isfinite(arrays[name]).all():
            raise ProtocolError(f"full_state.{name}: values must be finite")
    if arrays["min_p"].min() < 0 or arrays["min_p"].max() > 1:
        raise ProtocolError("full_state.min_p: values outside [0, 1]")
    if arrays["repetition_penalty"].min() <= 0:
        raise ProtocolError("full_state.repetition_penalty: values must be > 0")
    for name, low, high in (("min_tokens", 0, limits.max_seq_len), ("prompt_lens", 0, limits.max_seq_len - 1),
                            ("logprobs", -1, MAX_LOGPROBS)):
        if arrays[name].min() < low or arrays[name].max() > high:
            raise ProtocolError(f"full_state.{name}: values outside [{low}, {high}]")
    _check_token_ids(arrays["stop_ids"], limits, "full_state.stop_ids", allow_pad=True)
    return FullState(**arrays)


# Replies from the child: a wake-up is the bare step number; errors and the ready report are maps.
def encode_wakeup(step: int) -> bytes:
    return msgpack.packb(step)


def encode_error(step: int | None, message: str, traceback_text: str) -> bytes:
    return msgpack.packb({"error": message, "traceback": traceback_text, "step": step})
