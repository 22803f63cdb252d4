"""In-process tests of the chip runtime (no child processes): parity with transformers, the pool
and copy counters, copy policies, seeded sampling through the runtime, device-side bookkeeping and
the wire protocol's validation."""
from __future__ import annotations

import math
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.local import LocalDriver, LocalRequest
from chip_child.protocol import (
    OP_DECODE,
    OP_PREFILL,
    Admit,
    Chunk,
    Command,
    FullState,
    Limits,
    ProtocolError,
    Shutdown,
    decode,
    encode,
    prefill_command,
)
from chip_child.step.pool import LAZY_ZERO_BYTES, TaskArg, TensorPool
from chip_child.step import runtime as runtime_module
from chip_child.step.runtime import ChipRuntime, StepResult

from parity import assert_matches_transformers  # noqa: E402

NEW_TOKENS = 32


def make_runtime(path: Path, *, batch: int = 4, max_seq_len: int = 80, page_size: int = 4,
                 copy_policy: str = "dirty") -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=batch,
                                     max_seq_len=max_seq_len, page_size=page_size, copy_policy=copy_policy))


def random_prompts(lens: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def run_tokens(rt: ChipRuntime, requests: list[LocalRequest]) -> list[list[int]]:
    return LocalDriver(rt).run(requests).token_ids


@pytest.fixture(scope="module")
def default_ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


# -- parity with transformers ------------------------------------------------------------------

SHAPES = [
    # name, Qwen3Config overrides, page size, prompt lengths (mixed in one batch)
    pytest.param("tied-mha", dict(tie_word_embeddings=True, num_key_value_heads=4), 1, (1, 5, 13, 40),
                 id="tied-gqa1-page1"),
    pytest.param("default", {}, 3, (40, 1, 13, 5), id="untied-gqa2-hd24-page3"),
    pytest.param("gqa4-bias", dict(num_key_value_heads=1, attention_bias=True), 4, (5, 40, 1, 13),
                 id="gqa4-bias-page4"),
    pytest.param("wide", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                              tie_word_embeddings=True), 16, (13, 5, 40, 1), id="tied-gqa4-8heads-hd16-page16"),
]


@pytest.mark.parametrize("name,overrides,page_size,lens", SHAPES)
def test_greedy_tokens_and_logits_match_transformers(make_checkpoint, hf_model, name: str, overrides: dict,
                                                     page_size: int, lens: tuple[int, ...]) -> None:
    path = make_checkpoint(name, **overrides)
    model = hf_model(path)
    rt = make_runtime(path, page_size=page_size)
    prompts = random_prompts(lens, model.config.vocab_size, seed=len(name))
    res = LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in prompts], keep_logits=True)
    assert_matches_transformers(model, prompts, res.token_ids, res.logits, NEW_TOKENS)


def test_bfloat16_logits_track_transformers_in_bfloat16(default_ckpt: Path) -> None:
    """The low-precision branches (norms cast back, softmax in fp32, logits cast up) against
    transformers run in bfloat16 on the same checkpoint, fed the same tokens."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(default_ckpt, dtype=torch.bfloat16).eval()
    rt = ChipRuntime(RuntimeConfig(str(default_ckpt), device="cpu", dtype="bfloat16", max_batch_size=4,
                                   max_seq_len=80, page_size=3))
    assert rt.attn.kv_cache.dtype == torch.bfloat16
    prompts = random_prompts((13, 5), model.config.vocab_size, seed=7)
    res = LocalDriver(rt).run([LocalRequest(p, 8) for p in prompts], keep_logits=True)
    for prompt, tokens, logits in zip(prompts, res.token_ids, res.logits):
        with torch.no_grad():
            want = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        mine = torch.stack(logits)
        assert mine.dtype == torch.float32
        rel = ((mine - want).abs().max() / want.abs().max()).item()
        assert rel <= 0.03, f"prompt length {len(prompt)}: relative logits error {rel:.2e} in bfloat16"


def test_runtime_builds_with_one_token_pages(default_ckpt: Path) -> None:
    """Warm-up must give its 2-token prompt as many pages as the page size requires."""
    rt = make_runtime(default_ckpt, page_size=1)
    assert len(run_tokens(rt, [LocalRequest([1, 2, 3], 4)])[0]) == 4


# -- explicit commands -------------------------------------------------------------------------

class Stepper:
    """Drives a runtime with hand-built Commands and keeps the host's view of every row: its pages,
    next input position and whether it is active. Pages are handed out from the top of the cache
    down so no row's block table is contiguous or ascending."""

    def __init__(self, rt: ChipRuntime):
        self.rt = rt
        b = rt.cfg.max_batch_size
        self.page = rt.cfg.page_size
        self.out = torch.zeros(b, dtype=torch.int32)
        self.step = 0
        self.free = list(range(rt.cfg.total_pages - 1, 0, -1))
        self.pages: list[list[int]] = [[] for _ in range(b)]
        self.pos = np.zeros(b, np.int64)  # next input position of active rows
        self.active = np.zeros(b, bool)
        self.tokens: dict[int, list[int]] = {}
        self.last_slots = np.zeros(b, np.int64)

    def admit(self, rows_prompts: dict[int, list[int]], temperature: float = 0.0, top_p: float = 1.0,
              top_k: int = 0, seed: int = 0) -> StepResult:
        """Prefills the prompts in one step; rows already decoding take their step beside them."""
        decoding = np.flatnonzero(self.active)
        triples = self._boundary_pages()
        staging = np.concatenate([np.asarray(p, np.int32) for p in rows_prompts.values()])
        admits, offset = [], 0
        for row, prompt in rows_prompts.items():
            self.pages[row] = [self.free.pop(0) for _ in range(math.ceil(len(prompt) / self.page))]
            admits.append((Admit(row, len(prompt), temperature, top_p, top_k, seed),
                           np.array(self.pages[row], np.int32), offset))
            offset += len(prompt)
            self.tokens[row] = []
        cmd = prefill_command(self.step, admits)
        cmd.new_pages = np.concatenate([np.array(triples, np.int32).reshape(-1, 3), cmd.new_pages])
        result = self._execute(cmd, staging)
        for row in decoding:
            self.tokens[int(row)].append(int(self.out[row]))
        self.pos[decoding] += 1
        for row, prompt in rows_prompts.items():
            self.pos[row], self.active[row] = len(prompt), True
            self.tokens[row].append(int(self.out[row]))
        return result

    def _boundary_pages(self) -> list[tuple[int, int, int]]:
        """Pages for active rows whose next input starts one; records every active row's slot."""
        triples = []
        self.last_slots[:] = 0
        for row in np.flatnonzero(self.active):
            p = int(self.pos[row])
            if p % self.page == 0:
                self.pages[row].append(self.free.pop(0))
                triples.append((row, p // self.page, self.pages[row][-1]))
            self.last_slots[row] = self.pages[row][p // self.page] * self.page + p % self.page
        return triples

    def decode(self, finished: tuple[int, ...] = ()) -> StepResult:
        for row in finished:
            self.active[row], self.pos[row] = False, 0
        triples = self._boundary_pages()
        cmd = Command(step=self.step, finished_rows=list(finished),
                      new_pages=np.array(triples, np.int32).reshape(-1, 3))
        result = self._execute(cmd, np.zeros(1, np.int32))
        for row in np.flatnonzero(self.active):
            self.tokens[int(row)].append(int(self.out[row]))
        self.pos[self.active] += 1
        return result

    def _execute(self, cmd: Command, staging: np.ndarray) -> StepResult:
        result = self.rt.execute(decode(encode(cmd), self.rt.limits), staging, self.out)
        self.step += 1
        return result


def test_pool_hands_back_the_same_tensors_and_never_a_stale_answer() -> None:
    pool = TensorPool(torch.device("cpu"))
    first_args = (TaskArg("x", (2,), torch.float32, "in"),)
    first = pool.resolve("f", first_args)["x"]
    assert pool.resolve("f", (TaskArg("x", (2,), torch.float32, "in"),))["x"] is first  # equal, not the same tuple
    assert pool.allocations == 1
    wider = pool.resolve("f", (TaskArg("x", (3,), torch.float32, "in"),))["x"]
    assert wider.shape == (3,) and pool.allocations == 2
    assert pool.resolve("f", first_args)["x"] is first
    assert pool.resolve("g", first_args)["x"] is not first  # another callable owns its own tensors


def test_pool_allocations_flat_over_many_decode_steps(default_ckpt: Path) -> None:
    rt = make_runtime(default_ckpt, page_size=3)
    warm = rt.pool.allocations
    assert warm == rt.warm_pool_allocations > 0
    requests = [LocalRequest([1, 2, 3], 40), LocalRequest(list(range(20)), 25, temperature=0.8, top_k=7, seed=3),
                LocalRequest([9], 40, temperature=1.0, top_p=0.9, seed=4), LocalRequest([5, 6], 12)]
    for _ in range(2):  # a second batch reuses the same pooled tensors
        LocalDriver(rt).run(requests)
        assert rt.pool.allocations == warm


def test_timing_a_decode_step_leaves_the_runtime_as_it_was(default_ckpt: Path) -> None:
    """The start-up layout trial (cpu_layout="auto") times decode steps on a warm runtime: no pool
    allocation, and the same tokens afterwards as from a runtime that never timed one."""
    requests = [LocalRequest(p, 12) for p in random_prompts((3, 9, 1), 300, seed=11)]
    expected = run_tokens(make_runtime(default_ckpt, page_size=3), requests)
    rt = make_runtime(default_ckpt, page_size=3)  # prompts over several pages; max_seq_len 80
    for tokens, steps in ((1, 1), (64, 8), (10_000, 200)):  # the last capped by max_seq_len
        assert all(t > 0 for t in rt.time_steps(tokens, steps, budget_s=10.0))
    assert all(t > 0 for t in rt.time_steps(8, 1000, budget_s=0.0))  # out of budget: one timed step
    rt.reset()
    assert rt.pool.allocations == rt.warm_pool_allocations
    assert run_tokens(rt, requests) == expected


def test_timing_steps_stays_within_a_small_cache(default_ckpt: Path) -> None:
    def runtime(pages: int) -> ChipRuntime:
        return ChipRuntime(RuntimeConfig(str(default_ckpt), device="cpu", dtype="float32", max_batch_size=2,
                                         max_seq_len=80, page_size=2, num_pages=pages))
    assert all(t > 0 for t in runtime(3).time_steps(256, 4, budget_s=10.0))  # 6 positions: prompt 1, 4 steps
    with pytest.raises(ValueError, match="at least 3 positions"):
        runtime(1).time_steps(256, 4, budget_s=10.0)


def test_steady_decode_step_copies_nothing_to_the_device(default_ckpt: Path) -> None:
    rt = make_runtime(default_ckpt, page_size=4)
    s = Stepper(rt)
    first = s.admit({0: [1, 2, 3, 4, 5], 2: [7, 8]}, temperature=0.9, top_k=10, seed=1)
    assert first.pool_allocs == 0
    seen_boundary = seen_steady = False
    for _ in range(8):
        boundary = any(s.pos[r] % 4 == 0 for r in np.flatnonzero(s.active))
        result = s.decode()
        assert result.pool_allocs == 0
        if boundary:
            seen_boundary = True
            assert result.h2d_copies == 1 and result.h2d_bytes <= 3 * 8  # one (row, block, page) triple
        else:
            seen_steady = True
            assert (result.h2d_copies, result.h2d_bytes) == (0, 0)
    assert seen_boundary and seen_steady
    finishing = s.decode(finished=(0,))
    assert finishing.pool_allocs == 0 and finishing.h2d_copies >= 1
    assert rt.pool.allocations == rt.warm_pool_allocations


def test_device_positions_and_slot_mapping_equal_host_computation(default_ckpt: Path) -> None:
    page = 3
    rt = make_runtime(default_ckpt, page_size=page)
    s = Stepper(rt)

    def check(slots: bool = True) -> None:
        want_pos = np.where(s.active, s.pos, 0)
        assert rt.state["positions"].tolist() == want_pos.tolist()
        assert rt.positions_host().tolist() == want_pos.tolist()
        if slots:  # prefill leaves the last decode step's slot mapping alone
            assert rt.state["slot_mapping"].tolist() == s.last_slots.tolist()
        assert rt.state["active"].tolist() == s.active.tolist()
        table = rt.state["block_table"]
        for row in np.flatnonzero(s.active):
            assert table[row, :len(s.pages[row])].tolist() == s.pages[row]

    s.admit({0: [4] * 7, 1: [5], 3: [6] * 3})  # row 2 stays idle
    check(slots=False)
    for _ in range(7):
        s.decode()
        check()
    s.decode(finished=(1,))
    check()
    assert s.last_slots[1] == 0 and s.last_slots[2] == 0  # idle rows write to the scratch page
    s.admit({1: [8] * 4, 2: [9] * 2})  # joins while rows 0 and 3 are mid-generation
    check()
    for _ in range(5):
        s.decode()
        check()
    # The host's expectation is not trivially satisfied: pages were handed out top-down.
    assert s.pages[0][0] > s.pages[0][1] > 0


# -- copy policies and seeded sampling through the runtime -------------------------------------

MIXED_REQUESTS = [
    LocalRequest([3, 1, 4, 1, 5], 20),
    LocalRequest([2, 7], 14, temperature=0.8, seed=11),
    LocalRequest(list(range(30, 43)), 20, temperature=1.1, top_k=12, top_p=0.9, seed=12),
    LocalRequest([99], 9, temperature=0.7, top_p=0.8, seed=13),
]


def test_always_and_dirty_copy_policies_give_identical_tokens(default_ckpt: Path) -> None:
    results = {}
    for policy in ("dirty", "always"):
        rt = make_runtime(default_ckpt, page_size=3, copy_policy=policy)
        results[policy] = LocalDriver(rt).run(MIXED_REQUESTS, keep_logits=True)
    assert results["always"].token_ids == results["dirty"].token_ids
    assert [len(t) for t in results["dirty"].token_ids] == [r.max_new_tokens for r in MIXED_REQUESTS]
    for a, d in zip(results["always"].logits, results["dirty"].logits):
        torch.testing.assert_close(torch.stack(a), torch.stack(d), rtol=0, atol=1e-6)


def test_seeded_sampling_reproducible_across_runtimes(default_ckpt: Path) -> None:
    first = run_tokens(make_runtime(default_ckpt), MIXED_REQUESTS)
    second = run_tokens(make_runtime(default_ckpt, page_size=16), MIXED_REQUESTS)
    assert first == second


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                      dict(temperature=1.3, top_p=0.85), dict(temperature=0.9, top_k=8, top_p=0.7)],
                         ids=["temp", "top_k", "top_p", "top_k+top_p"])
def test_seeded_request_ignores_its_batch_neighbours(default_ckpt: Path, sampling: dict) -> None:
    rt = make_runtime(default_ckpt)
    target = LocalRequest([10, 20, 30, 40, 50, 60], 24, seed=1234, **sampling)
    alone = run_tokens(rt, [target])[0]
    neighbours = [LocalRequest([1] * 9, 24, temperature=1.0, seed=5), LocalRequest([2, 3], 24),
                  LocalRequest(list(range(100, 117)), 24, temperature=0.5, top_k=3, seed=6)]
    in_row_2 = run_tokens(rt, neighbours[:2] + [target] + neighbours[2:])[2]
    in_row_3 = run_tokens(rt, neighbours + [target])[3]
    assert alone == in_row_2 == in_row_3

    other_seed = run_tokens(rt, [LocalRequest(target.prompt, 24, seed=4321, **sampling)])[0]
    assert other_seed != alone


def test_seeded_request_admitted_mid_generation_matches_alone(default_ckpt: Path) -> None:
    sampling = dict(temperature=1.0, top_k=30, seed=77)
    prompt = [11, 22, 33]
    alone = Stepper(make_runtime(default_ckpt))
    alone.admit({0: prompt}, **sampling)
    for _ in range(11):
        alone.decode()

    busy = Stepper(make_runtime(default_ckpt))
    busy.admit({0: [5] * 6, 2: [6] * 2}, temperature=0.9, seed=3)
    for _ in range(5):
        busy.decode()
    busy.admit({3: prompt}, **sampling)
    for _ in range(11):
        busy.decode()
    assert busy.tokens[3] == alone.tokens[0]


def test_a_chunk_steps_forward_runs_only_the_lanes_up_to_the_highest_decoding_row(default_ckpt: Path,
                                                                                  monkeypatch) -> None:
    """A prompt on an idle runtime is its own tokens in the forward (no lane: a 128-token prompt
    is 128 rows, not 129); beside decoding rows, the lanes up to the highest of them. Every row's
    greedy tokens equal its own run alone, whether its row is inside those lanes or above them."""
    rows_seen: list[int] = []
    real = runtime_module.forward

    def counting(cfg, weights, attn, plan, rope, tokens, *args, **kwargs):
        rows_seen.append(tokens.shape[0])
        return real(cfg, weights, attn, plan, rope, tokens, *args, **kwargs)

    monkeypatch.setattr(runtime_module, "forward", counting)
    prompts = {1: [5, 6, 7, 8, 9], 0: [12, 13, 14], 3: [21, 22, 23, 24]}

    def alone(prompt: list[int]) -> list[int]:
        s = Stepper(make_runtime(default_ckpt))
        s.admit({0: prompt})
        for _ in range(6):
            s.decode()
        return s.tokens[0][:4]

    expected = {row: alone(p) for row, p in prompts.items()}
    s = Stepper(make_runtime(default_ckpt))
    rows_seen.clear()
    s.admit({1: prompts[1]})
    assert rows_seen[0] == 5  # nothing decoded before: no lane
    s.decode()
    rows_seen.clear()
    s.admit({0: prompts[0]})  # below the decoding row 1: lanes 0 and 1, then the chunk
    assert rows_seen[0] == 2 + 3
    rows_seen.clear()
    s.admit({3: prompts[3]})  # above the decoding rows 0 and 1
    assert rows_seen[0] == 2 + 4
    for _ in range(4):
        s.decode()
    assert {row: s.tokens[row][:4] for row in prompts} == expected


def test_top_k_one_equals_greedy(default_ckpt: Path) -> None:
    rt = make_runtime(default_ckpt)
    prompts = random_prompts((3, 8, 1), 300, seed=9)
    greedy = run_tokens(rt, [LocalRequest(p, 16) for p in prompts])
    top1 = run_tokens(rt, [LocalRequest(p, 16, temperature=1.5, top_k=1, seed=i) for i, p in enumerate(prompts)])
    hot = run_tokens(rt, [LocalRequest(p, 16, temperature=1.5, seed=i) for i, p in enumerate(prompts)])
    assert top1 == greedy
    assert hot != greedy  # the same temperature without top_k=1 does sample


# -- protocol validation -----------------------------------------------------------------------

LIMITS = Limits(max_batch_size=4, max_blocks_per_row=8, num_pages=33, max_seq_len=32, max_prefill_tokens=64,
                page_size=4)


def _admit(**changes) -> Admit:
    fields = dict(row=1, prompt_len=5, temperature=0.5, top_p=0.9, top_k=4, seed=2**40)
    fields.update(changes)
    return Admit(**fields)


def test_protocol_round_trips_valid_commands() -> None:
    cmd = Command(step=7, finished_rows=[0, 3], new_pages=np.array([[1, 7, 32], [2, 0, 1]], np.int32))
    got = decode(encode(cmd), LIMITS)
    assert (got.step, got.finished_rows, got.new_pages.tolist()) == (7, [0, 3], [[1, 7, 32], [2, 0, 1]])
    prefill = decode(encode(Command(step=0, admits=[_admit()], chunks=[Chunk(1, 0, 5, 3, True), Chunk(2, 8, 4, 8, False)])),
                     LIMITS)
    a = prefill.admits[0]
    assert (a.row, a.prompt_len, a.top_k, a.seed) == (1, 5, 4, 2**40)
    assert prefill.chunks == [Chunk(1, 0, 5, 3, True), Chunk(2, 8, 4, 8, False)]
    assert isinstance(decode(encode(Shutdown()), LIMITS), Shutdown)
    assert len(encode(Command(step=5))) <= 8  # a steady decode step is a handful of bytes


def _decode_cmd(**changes) -> bytes:
    cmd = Command(step=1, new_pages=np.zeros((0, 3), np.int32))
    for k, v in changes.items():
        setattr(cmd, k, v)
    return encode(cmd)


@pytest.mark.parametrize("raw,match", [
    (b"\xc1\x00garbage", "undecodable"),
    (b"\x93\x00\x01", "undecodable"),  # truncated array
    (msgpack.packb([7, 1, [], b""]), "unknown op"),
    (msgpack.packb({"op": 0}), "unknown op"),
    (msgpack.packb([OP_DECODE, 1]), "must be"),
    (_decode_cmd(finished_rows=[4]), r"finished_rows: row 4 outside \[0, 4\)"),
    (_decode_cmd(finished_rows=[-1]), "finished_rows: row -1"),
    (_decode_cmd(new_pages=np.array([[4, 0, 1]], np.int32)), r"new_pages: row 4 outside"),
    (_decode_cmd(new_pages=np.array([[0, 0, 0]], np.int32)), r"new_pages: page id outside \[1, 33\)"),
    (_decode_cmd(new_pages=np.array([[0, 0, 33]], np.int32)), r"new_pages: page id outside \[1, 33\)"),
    (_decode_cmd(new_pages=np.array([[0, 8, 1]], np.int32)), r"block index outside \[0, 8\)"),
    (_decode_cmd(new_pages=np.array([[0, -1, 1]], np.int32)), r"block index outside"),
    (msgpack.packb([OP_DECODE, 1, [], b"\x00" * 8]), "not a multiple of 3"),
    (msgpack.packb([OP_DECODE, 1, [], b"\x00" * 5]), "int32 bytes"),
    (encode(Command(step=0, admits=[_admit(row=4)])), r"admit: row 4 outside"),
    (encode(Command(step=0, admits=[_admit(prompt_len=0)])), "prompt_len 0"),
    (encode(Command(step=0, admits=[_admit(), _admit()])), "row appears twice"),
    (encode(Command(step=0, chunks=[Chunk(4, 0, 2, 0, True)])), r"chunk: row 4 outside"),
    (encode(Command(step=0, chunks=[Chunk(0, 30, 3, 0, True)])), r"positions \[30, 33\) outside \[0, 32\)"),
    (encode(Command(step=0, chunks=[Chunk(0, 0, 0, 0, True)])), r"positions \[0, 0\)"),
    (encode(Command(step=0, chunks=[Chunk(0, 0, 5, 62, True)])), "staging range"),
    (encode(Command(step=0, chunks=[Chunk(0, 0, 2, 0, True), Chunk(0, 2, 2, 2, True)])), "row appears twice"),
    (msgpack.packb([OP_PREFILL, 0, [], b"", [], np.array([0, 0, 2, 0, 2], np.int32).tobytes()]), "last must be"),
    (msgpack.packb([OP_PREFILL, 0, [], b"", [], b"\x00" * 8]), "not a multiple of 5"),
    (msgpack.packb([OP_PREFILL, 0, [], b"", []]), "a prefill command is"),
    (msgpack.packb([OP_PREFILL, 0, [], b"", [], b""]), "without admits or chunks"),
], ids=["garbage", "truncated", "unknown-op", "not-a-list", "short", "finished-row-high", "finished-row-negative",
        "triple-row", "page-0", "page-too-high", "block-too-high", "block-negative", "triples-length",
        "triples-bytes", "admit-row", "admit-empty", "admit-duplicate", "chunk-row", "chunk-past-max-seq-len",
        "chunk-empty", "chunk-staging", "chunk-duplicate", "chunk-last-flag", "chunks-length", "prefill-short",
        "prefill-empty"])
def test_protocol_rejects_bad_commands(raw: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(raw, LIMITS)


def test_protocol_rejects_bad_full_state() -> None:
    b, mb = LIMITS.max_batch_size, LIMITS.max_blocks_per_row

    def full_state(**changes) -> FullState:
        fields = dict(positions=np.zeros(b, np.int64), active=np.zeros(b, bool),
                      block_table=np.zeros((b, mb), np.int32), slot_mapping=np.zeros(b, np.int64),
                      temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32),
                      top_k=np.zeros(b, np.int64), seed_keys=np.zeros(b, np.int64))
        fields.update(changes)
        return FullState(**fields)

    ok = decode(encode(Command(step=2, full_state=full_state())), LIMITS)
    assert ok.full_state is not None and ok.full_state.block_table.shape == (b, mb)
    with pytest.raises(ProtocolError, match="full_state.positions"):
        decode(encode(Command(step=2, full_state=full_state(positions=np.zeros(b + 1, np.int64)))), LIMITS)
    bad_table = np.zeros((b, mb), np.int32)
    bad_table[1, 2] = LIMITS.num_pages
    with pytest.raises(ProtocolError, match="full_state.block_table"):
        decode(encode(Command(step=2, full_state=full_state(block_table=bad_table))), LIMITS)
    with pytest.raises(ProtocolError, match="full_state.slot_mapping"):
        slots = np.full(b, LIMITS.num_pages * LIMITS.page_size, np.int64)
        decode(encode(Command(step=2, full_state=full_state(slot_mapping=slots))), LIMITS)


def test_runtime_limits_match_its_config(default_ckpt: Path) -> None:
    rt = make_runtime(default_ckpt, batch=3, max_seq_len=40, page_size=16)
    assert rt.limits == Limits(3, 3, 3 * 3 + 1, 40, 2048, 16, vocab_size=300)
    with pytest.raises(ProtocolError, match="page id outside"):
        decode(encode(Command(step=0, new_pages=np.array([[0, 0, 10]], np.int32))), rt.limits)


def test_a_large_host_tensor_is_zeroed_by_the_os_at_first_touch_not_at_start() -> None:
    """The KV cache's size comes from a memory share (gigabytes): its pages are not written at
    allocation; every element still reads 0. Sleep mode's pool keeps resizable storage."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    shape = (LAZY_ZERO_BYTES // 2 + 8,)  # bf16 elements: just over the threshold
    before = rss()
    pool = TensorPool(torch.device("cpu"))
    big = pool.get("kv", "cache", shape, torch.bfloat16)
    assert rss() - before < LAZY_ZERO_BYTES // 4  # nothing written yet
    assert not big.untyped_storage().resizable()
    assert big[-1].item() == 0 and big[::4096].abs().sum().item() == 0
    big[7] = 3.0
    assert big[7].item() == 3.0 and big.count_nonzero().item() == 1
    big.fill_(1.0)  # every page written ...
    assert rss() - before > LAZY_ZERO_BYTES // 2
    pool.zero(big)  # ... and handed back: zeros again, without writing them
    assert big.count_nonzero().item() == 0 and rss() - before < LAZY_ZERO_BYTES // 4
    small = TensorPool(torch.device("cpu")).get("kv", "cache", (16,), torch.float32)
    kept = TensorPool(torch.device("cpu"), resizable=True).get("kv", "cache", shape, torch.bfloat16)
    assert small.untyped_storage().resizable() and kept.untyped_storage().resizable()
    assert kept.count_nonzero().item() == 0
