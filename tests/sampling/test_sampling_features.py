"""The optional sampling stages on the device: penalties, min_p, the min_tokens stop-id mask,
log-probabilities of generated and prompt tokens. Checked in-process against transformers'
fp32 logits put through the documented formulas, plus batch independence, copy policies, the
steady step's copies, the wire fields and the child writing the ring."""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import chip_child.sampling.prompt_logprobs as prompt_logprobs_module
import chip_child.step.runtime as runtime_module
from chip_child.step import row_fields
from chip_child.config import RuntimeConfig
from chip_child.local import LocalDriver, LocalRequest, LocalResult
from chip_child.protocol import Admit, Command, FullState, Limits, ProtocolError, decode, encode, prefill_command
from chip_child.step.runtime import ChipRuntime, StepOutputs
from chip_child.sampling.noise import vocab_hash
from chip_child.sampling.sampler import seed_key, uniform_noise

VOCAB = 300


def make_runtime(path: Path, copy_policy: str = "dirty", batch: int = 4) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=batch,
                                     max_seq_len=96, page_size=4, copy_policy=copy_policy))


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("default")


@pytest.fixture(scope="module")
def rt(ckpt: Path) -> ChipRuntime:
    return make_runtime(ckpt)


@pytest.fixture(scope="module")
def model(ckpt: Path, hf_model):
    return hf_model(ckpt)


def prompts(*lens: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


# -- the reference: transformers' logits through the documented formulas ------------------------

def hf_step_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' fp32 logits at every generation step, teacher-forced on the tokens generated:
    row g is the distribution generated token g was drawn from (raw)."""
    with torch.no_grad():
        return model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]


def processed(raw: torch.Tensor, req: LocalRequest, history: list[int]) -> torch.Tensor:
    """Stop ids masked before min_tokens, then the repetition, frequency and presence penalties."""
    x = raw.clone()
    if len(history) < req.min_tokens:
        x[req.stop_ids] = -math.inf
    counts = torch.bincount(torch.tensor(history, dtype=torch.int64), minlength=x.numel()).float()
    seen = (counts > 0) | torch.isin(torch.arange(x.numel()), torch.tensor(req.prompt))
    rep = req.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - req.frequency_penalty * counts - req.presence_penalty * (counts > 0).float()


def reference_token(x: torch.Tensor, req: LocalRequest, position: int) -> int:
    """Greedy: the argmax. Seeded: temperature, min_p, then the Gumbel draw with the runtime's noise."""
    if req.temperature == 0:
        return int(x.argmax())
    scaled = x / req.temperature
    probs = scaled.softmax(-1)
    scaled = torch.where(probs < req.min_p * probs.max(), -math.inf, scaled)
    noise = uniform_noise(torch.tensor([seed_key(req.seed)]), torch.tensor([position]),
                          vocab_hash(x.numel(), torch.device("cpu")))[0]
    return int((scaled - torch.log(-torch.log(noise))).argmax())


def assert_matches_reference(model, req: LocalRequest, generated: list[int]) -> None:
    raw = hf_step_logits(model, req.prompt, generated)
    for g, token in enumerate(generated):
        want = reference_token(processed(raw[g], req, generated[:g]), req, len(req.prompt) - 1 + g)
        assert token == want, f"generated token {g}: {token}, reference {want} ({req})"


def reference_logprobs(model, req: LocalRequest, generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: log_softmax of the processed logits over the temperature (1 when greedy)."""
    raw = hf_step_logits(model, req.prompt, generated)
    temperature = req.temperature or 1.0
    return torch.stack([(processed(raw[g], req, generated[:g]) / temperature).log_softmax(-1)
                        for g in range(len(generated))])


def assert_logprobs_close(got, want_row: torch.Tensor, chosen: int, n: int, what: str) -> None:
    """One position: the chosen token's value, and the top n (values, and ids by their values)."""
    assert abs(got.logprob - want_row[chosen].item()) <= 1e-4, f"{what}: chosen token's logprob"
    assert len(got.top_ids) == len(got.top_logprobs) == n
    top = want_row.topk(n)
    assert np.allclose(got.top_logprobs, top.values.tolist(), atol=1e-4, rtol=0), f"{what}: top {n} values"
    assert np.allclose(want_row[got.top_ids].tolist(), got.top_logprobs, atol=1e-4, rtol=0), f"{what}: top ids"
    assert got.top_logprobs == sorted(got.top_logprobs, reverse=True), f"{what}: most likely first"


# -- log-probabilities -----------------------------------------------------------------------------

def test_logprobs_and_prompt_logprobs_match_transformers(rt, model, monkeypatch) -> None:
    # Prompt log-probabilities are computed a few positions at a time: cross several chunk boundaries.
    monkeypatch.setattr(prompt_logprobs_module, "PROMPT_LOGPROB_ROWS", 4)
    p = prompts(9, 14, 1, 6, seed=1)
    reqs = [
        LocalRequest(p[0], 10, logprobs=5, prompt_logprobs=3),
        LocalRequest(p[1], 10, temperature=0.8, seed=7, logprobs=20, prompt_logprobs=20, presence_penalty=0.5,
                     frequency_penalty=0.3, repetition_penalty=1.3),
        LocalRequest(p[2], 10, logprobs=0, prompt_logprobs=2, min_tokens=4, stop_ids=[5, 6]),
        LocalRequest(p[3], 10, temperature=1.2, seed=8, min_p=0.3, prompt_logprobs=0),
    ]
    res = LocalDriver(rt).run(reqs)
    for i, (req, generated) in enumerate(zip(reqs, res.token_ids)):
        if req.logprobs < 0:
            assert res.logprobs[i] is None
        else:
            want = reference_logprobs(model, req, generated)
            assert len(res.logprobs[i]) == len(generated)
            for g, got in enumerate(res.logprobs[i]):
                assert_logprobs_close(got, want[g], generated[g], req.logprobs, f"request {i}, token {g}")
        with torch.no_grad():
            prompt_want = model(torch.tensor([req.prompt])).logits[0].log_softmax(-1)
        assert len(res.prompt_logprobs[i]) == len(req.prompt) - 1
        for j in range(1, len(req.prompt)):
            assert_logprobs_close(res.prompt_logprobs[i][j - 1], prompt_want[j - 1], req.prompt[j],
                                  req.prompt_logprobs, f"request {i}, prompt token {j}")


def test_logprobs_are_only_computed_when_asked_and_outputs_given(rt) -> None:
    out = torch.zeros(rt.cfg.max_batch_size, dtype=torch.int32)
    outputs = StepOutputs.allocate(rt.cfg.max_batch_size, rt.cfg.prefill_capacity)
    staging = np.array([1, 2, 3, 4, 5], np.int32)
    plain = Admit(0, 5, 0.0, 1.0, 0, 0)
    asking = dataclasses.replace(plain, row=1, logprobs=3, prompt_logprobs=2)
    step = rt.execute(prefill_command(0, [(plain, np.array([1, 2], np.int32), 0)]), staging, out, outputs)
    assert (step.logprobs, step.prompt_logprobs) == (-1, False)
    step = rt.execute(Command(1), staging, out, outputs)
    assert (step.logprobs, step.prompt_logprobs) == (-1, False)
    step = rt.execute(prefill_command(2, [(asking, np.array([3, 4], np.int32), 0)]), staging, out, outputs)
    assert (step.logprobs, step.prompt_logprobs) == (3, True)
    assert rt.execute(Command(3), staging, out, outputs).logprobs == 3
    assert rt.execute(Command(4), staging, out).logprobs == -1  # no outputs, nothing computed
    assert rt.execute(Command(5, finished_rows=[1]), staging, out, outputs).logprobs == -1
    rt.finish_rows([0])


# -- penalties, min_p --------------------------------------------------------------------------------

FEATURES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.6),
    "repetition": dict(repetition_penalty=1.8),
    "all-penalties": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5),
    "min_p": dict(min_p=0.4),
}


@pytest.mark.parametrize("feature", FEATURES.values(), ids=FEATURES.keys())
def test_penalties_and_min_p_match_reference(rt, model, feature: dict) -> None:
    """Greedy and seeded rows with the feature and without it, in one batch, same prompt."""
    prompt = prompts(7, seed=3)[0]
    seeded = dict(temperature=0.6, seed=21)
    reqs = [LocalRequest(prompt, 16, **feature), LocalRequest(prompt, 16, **seeded, **feature),
            LocalRequest(prompt, 16), LocalRequest(prompt, 16, **seeded)]
    tokens = LocalDriver(rt).run(reqs).token_ids
    for req, generated in zip(reqs, tokens):
        assert_matches_reference(model, req, generated)
    assert tokens[1] != tokens[3], "the feature changed nothing for the seeded row"
    if "min_p" not in feature:  # min_p cannot change a greedy row
        assert tokens[0] != tokens[2], "the penalty changed nothing for the greedy row"
    else:
        assert tokens[0] == tokens[2]


# -- min_tokens ------------------------------------------------------------------------------------

def test_min_tokens_masks_stop_ids_greedy(rt, model) -> None:
    prompt = prompts(6, seed=4)[0]
    m = 5
    plain = LocalDriver(rt).run([LocalRequest(prompt, 12)]).token_ids[0]
    first = LocalRequest(prompt, 12, min_tokens=m, stop_ids=[plain[0]])
    masked = LocalDriver(rt).run([first]).token_ids[0]
    assert masked[0] != plain[0]  # the greedy choice was a stop id, masked
    assert plain[0] not in masked[:m]
    assert_matches_reference(model, first, masked)
    # The token chosen at index m is made a stop id too: still masked before m, sampled at m.
    later = masked[m]
    assert later not in masked[:m] and later != plain[0]
    both = LocalRequest(prompt, 12, min_tokens=m, stop_ids=[plain[0], later])
    again = LocalDriver(rt).run([both]).token_ids[0]
    assert again[:m] == masked[:m] and again[m] == later
    assert_matches_reference(model, both, again)


def test_min_tokens_masks_stop_ids_seeded(rt, model) -> None:
    prompt = prompts(5, seed=5)[0]
    stops = list(range(0, VOCAB, 2))  # half the vocabulary
    req = LocalRequest(prompt, 24, temperature=1.0, seed=99, min_tokens=8, stop_ids=stops)
    neighbour = LocalRequest(prompt, 24, temperature=1.0, seed=99)
    tokens, free = LocalDriver(rt).run([req, neighbour]).token_ids
    assert not set(tokens[:8]) & set(stops)
    assert set(tokens[8:]) & set(stops), "stop ids were still masked after min_tokens"
    assert set(free[:8]) & set(stops)  # the same seed without min_tokens does draw them
    assert_matches_reference(model, req, tokens)


# -- batch independence and copy policies -------------------------------------------------------------

TARGET = LocalRequest([10, 20, 30, 40, 50, 60], 20, temperature=0.9, seed=1234, min_p=0.2, presence_penalty=0.5,
                      frequency_penalty=0.2, repetition_penalty=1.3, min_tokens=4, stop_ids=[7, 8, 9], logprobs=4)
NEIGHBOURS = [LocalRequest([1] * 9, 20, temperature=1.0, seed=5, repetition_penalty=1.7, logprobs=20),
              LocalRequest([2, 3], 12),
              LocalRequest(list(range(100, 117)), 20, temperature=0.5, top_k=3, seed=6, min_tokens=15,
                           stop_ids=list(range(50)))]


def _target_run(ckpt: Path, policy: str, batch: list[LocalRequest], row: int) -> tuple[list[int], LocalResult]:
    res = LocalDriver(make_runtime(ckpt, policy)).run(batch)
    return res.token_ids[row], res


def test_seeded_rows_ignore_neighbours_and_copy_policy(ckpt: Path) -> None:
    runs = {}
    for policy in ("dirty", "always"):
        runs[policy, "alone"] = _target_run(ckpt, policy, [TARGET], 0)
        runs[policy, "row 2"] = _target_run(ckpt, policy, NEIGHBOURS[:2] + [TARGET] + NEIGHBOURS[2:], 2)
    reference_tokens, reference = runs["dirty", "alone"]
    for key, (tokens, res) in runs.items():
        assert tokens == reference_tokens, key
        row = 0 if key[1] == "alone" else 2
        for got, want in zip(res.logprobs[row], reference.logprobs[0]):
            assert got.top_ids == want.top_ids, key
            assert np.allclose([got.logprob] + got.top_logprobs, [want.logprob] + want.top_logprobs,
                               atol=1e-6, rtol=0), key
    # The whole batch too, under both policies.
    assert runs["dirty", "row 2"][1].token_ids == runs["always", "row 2"][1].token_ids


def test_always_policy_loads_the_sampling_parameters_it_is_sent(ckpt: Path) -> None:
    """copy_policy="always" takes every sampling parameter from the full state, not from admission."""
    rt = make_runtime(ckpt, "always", batch=2)
    s = Steps(rt)
    s.run(prefill_command(0, [(Admit(1, 3, 0.0, 1.0, 0, 0), np.array([1], np.int32), 0)]), np.array([4, 5, 6], np.int32))
    b, mb = 2, rt.cfg.max_blocks_per_row
    table = np.zeros((b, mb), np.int32)
    table[1, 0] = 1
    fs = FullState(positions=np.array([0, 3]), active=np.array([False, True]), block_table=table,
                   slot_mapping=np.array([0, 4 + 3]), temperature=np.array([0, 0.7], np.float32),
                   top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int64),
                   seed_keys=np.array([0, seed_key(5)]), min_p=np.array([0, 0.25], np.float32),
                   presence_penalty=np.array([0, 0.5], np.float32), frequency_penalty=np.array([0, 0.75], np.float32),
                   repetition_penalty=np.array([1, 1.5], np.float32), min_tokens=np.array([0, 6]),
                   prompt_lens=np.array([0, 3]), logprobs=np.array([-1, 7]),
                   stop_ids=np.array([[-1, -1], [11, 12]], np.int32))
    result, _ = s.run(Command(1, full_state=fs))
    assert result.logprobs == 7
    state = rt.state
    assert state["temperature"][1].item() == pytest.approx(0.7) and state["seed_keys"][1].item() == seed_key(5)
    assert (state["min_p"][1].item(), state["presence_penalty"][1].item(), state["frequency_penalty"][1].item(),
            state["repetition_penalty"][1].item()) == (0.25, 0.5, 0.75, 1.5)
    assert state["min_pos"].tolist() == [0, 3 - 1 + 6]
    assert state["stop_mask"][1].nonzero().flatten().tolist() == [11, 12] and not state["stop_mask"][0].any()
    assert s.tokens[1][-1] not in (11, 12)


def test_plain_seeded_row_keeps_its_tokens_next_to_featured_rows(rt) -> None:
    plain = LocalRequest([4, 4, 2], 16, temperature=1.1, top_p=0.9, seed=42)
    alone = LocalDriver(rt).run([plain]).token_ids[0]
    busy = LocalDriver(rt).run([NEIGHBOURS[0], plain, TARGET]).token_ids[1]
    assert busy == alone


# -- the steady step -------------------------------------------------------------------------------

class Steps:
    """Hand-built commands, encoded and decoded as a child would receive them."""

    def __init__(self, rt: ChipRuntime):
        self.rt = rt
        self.out = torch.zeros(rt.cfg.max_batch_size, dtype=torch.int32)
        self.outputs = StepOutputs.allocate(rt.cfg.max_batch_size, rt.cfg.prefill_capacity)
        self.step = 0
        self.tokens: dict[int, list[int]] = {}

    def run(self, cmd: Command, staging: np.ndarray = np.zeros(1, np.int32)):
        raw = encode(cmd)
        result = self.rt.execute(decode(raw, self.rt.limits), staging, self.out, self.outputs)
        self.step += 1
        for row in [a.row for a in cmd.admits] or list(self.tokens):
            self.tokens.setdefault(row, []).append(int(self.out[row]))
        return result, len(raw)


def test_steady_decode_steps_copy_nothing_and_plain_batches_take_the_plain_sampler(ckpt: Path,
                                                                                   monkeypatch) -> None:
    # Page size 32: no page boundary in this test, so every decode step is a steady one.
    rt = ChipRuntime(RuntimeConfig(str(ckpt), device="cpu", dtype="float32", max_batch_size=4, max_seq_len=64,
                                   page_size=32))
    calls = {"n": 0}
    real = runtime_module.sample_with_features

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "sample_with_features", counting)
    s = Steps(rt)
    prompt_a, prompt_b = [3, 1, 4, 1, 5, 9], [2, 7, 1, 8]
    staging = np.array(prompt_a + prompt_b, np.int32)
    featured = [(Admit(0, 6, 0.8, 1.0, 0, 11, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5,
                       repetition_penalty=1.2, min_tokens=3, stop_ids=np.array([1, 2], np.int32), logprobs=5),
                 np.array([1], np.int32), 0),
                (Admit(1, 4, 0.0, 1.0, 0, 0, repetition_penalty=1.5), np.array([2], np.int32), 6)]
    first, _ = s.run(prefill_command(0, featured), staging)
    assert first.pool_allocs == 0 and first.logprobs == 5
    for _ in range(8):
        result, size = s.run(Command(s.step))
        assert (result.h2d_copies, result.h2d_bytes, result.pool_allocs, size) == (0, 0, 0, 6)
        assert result.logprobs == 5
    assert calls["n"] == 9  # the prefill and every decode step ran the optional stages
    # The output counts and the prompt tokens were kept on the device, with nothing sent per step.
    for row, prompt in ((0, prompt_a), (1, prompt_b)):
        counts = torch.bincount(torch.tensor(s.tokens[row]), minlength=VOCAB).float()
        assert torch.equal(rt.state["output_counts"][row], counts)
        assert rt.state["prompt_seen"][row].nonzero().flatten().tolist() == sorted(set(prompt))

    # Both rows finish; a plain batch takes their place and runs the plain sampler only.
    plain = [(Admit(2, 6, 0.0, 1.0, 0, 0), np.array([3], np.int32), 0),
             (Admit(3, 4, 0.9, 0.8, 5, 3), np.array([4], np.int32), 6)]
    s.tokens.clear()
    s.run(prefill_command(s.step, plain, finished_rows=[0, 1]), staging)
    calls["n"] = 0
    for _ in range(8):
        result, size = s.run(Command(s.step))
        assert (result.h2d_copies, result.h2d_bytes, result.pool_allocs, size, result.logprobs) == (0, 0, 0, 6, -1)
    assert calls["n"] == 0
    assert rt.pool.allocations == rt.warm_pool_allocations


def test_min_tokens_mask_ends_without_the_host(ckpt: Path, monkeypatch) -> None:
    """The stop-id mask runs only while a row is short of min_tokens; then the plain sampler."""
    rt = ChipRuntime(RuntimeConfig(str(ckpt), device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64,
                                   page_size=32))
    features = []
    real = runtime_module.sample_with_features
    monkeypatch.setattr(runtime_module, "sample_with_features",
                        lambda *a, **k: features.append(a[6]) or real(*a, **k))
    s = Steps(rt)
    admit = Admit(0, 3, 0.0, 1.0, 0, 0, min_tokens=4, stop_ids=np.array([9], np.int32))
    s.run(prefill_command(0, [(admit, np.array([1], np.int32), 0)]), np.array([5, 6, 7], np.int32))
    for _ in range(6):
        assert s.run(Command(s.step))[0].h2d_copies == 0
    # Generated tokens 0..3 are masked: the prefill and three decode steps.
    assert len(features) == 4 and all(f.stop_mask for f in features)


# -- the wire --------------------------------------------------------------------------------------

LIMITS = Limits(max_batch_size=4, max_blocks_per_row=8, num_pages=33, max_seq_len=32, max_prefill_tokens=64,
                page_size=4, vocab_size=VOCAB)


def _admit(**changes) -> Admit:
    fields = dict(row=1, prompt_len=5, temperature=0.5, top_p=0.9, top_k=4, seed=2**40, min_p=0.25, presence_penalty=-1.5, frequency_penalty=0.75,
                  repetition_penalty=1.25, min_tokens=7, stop_ids=np.array([0, 299, 17], np.int32), logprobs=20,
                  prompt_logprobs=0)
    fields.update(changes)
    return Admit(**fields)


def test_admit_round_trip_keeps_every_field() -> None:
    sent = _admit()
    got = decode(encode(Command(step=0, admits=[sent])), LIMITS).admits[0]
    for f in dataclasses.fields(Admit):
        a, b = getattr(sent, f.name), getattr(got, f.name)
        assert (a.tolist() == b.tolist()) if isinstance(a, np.ndarray) else a == b, f.name
    defaults = decode(encode(Command(step=0, admits=[Admit(0, 1, 0.0, 1.0, 0, 0)])),
                      LIMITS).admits[0]
    assert (defaults.min_p, defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty,
            defaults.min_tokens, defaults.stop_ids.tolist(), defaults.logprobs, defaults.prompt_logprobs) == \
        (0.0, 0.0, 0.0, 1.0, 0, [], -1, -1)


@pytest.mark.parametrize("changes, message", [
    (dict(min_p=1.5), "admit: min_p "),
    (dict(min_p=-0.1), "admit: min_p "),
    (dict(min_p=float("nan")), "admit: min_p "),
    (dict(min_p="0.1"), "admit: min_p "),
    (dict(presence_penalty=float("inf")), "admit: presence_penalty "),
    (dict(frequency_penalty=None), "admit: frequency_penalty "),
    (dict(repetition_penalty=0.0), "admit: repetition_penalty "),
    (dict(repetition_penalty=-1.0), "admit: repetition_penalty "),
    (dict(min_tokens=-1), "admit: min_tokens "),
    (dict(min_tokens=33), "admit: min_tokens "),
    (dict(min_tokens=2.0), "admit: min_tokens "),
    (dict(min_tokens=True), "admit: min_tokens "),
    (dict(stop_ids=b"\x00\x01\x02"), "admit stop_ids: expected int32"),
    (dict(stop_ids=[1, 2]), "admit stop_ids: expected int32"),
    (dict(stop_ids=np.array([300], np.int32).tobytes()), "admit stop_ids: token id outside"),
    (dict(stop_ids=np.array([-1], np.int32).tobytes()), "admit stop_ids: token id outside"),
    (dict(logprobs=21), "admit: logprobs "),
    (dict(logprobs=-2), "admit: logprobs "),
    (dict(logprobs=1.0), "admit: logprobs "),
    (dict(prompt_logprobs=21), "admit: prompt_logprobs "),
    (dict(prompt_logprobs="3"), "admit: prompt_logprobs "),
])
def test_malformed_new_admit_fields_are_refused(changes: dict, message: str) -> None:
    raw = msgpack.unpackb(encode(Command(step=0, admits=[_admit()])))
    names = [f.name for f in dataclasses.fields(Admit)]
    for name, value in changes.items():
        raw[4][0][names.index(name)] = value
    with pytest.raises(ProtocolError, match=message):
        decode(msgpack.packb(raw), LIMITS)


def test_admit_of_the_first_six_fields_uses_no_optional_feature() -> None:
    raw = msgpack.unpackb(encode(Command(step=0, admits=[_admit()])))
    raw[4][0] = raw[4][0][:6]
    short = decode(msgpack.packb(raw), LIMITS).admits[0]
    assert (short.row, short.seed, short.min_p, short.presence_penalty, short.frequency_penalty,
            short.repetition_penalty, short.min_tokens, short.stop_ids.tolist(), short.logprobs,
            short.prompt_logprobs) == (1, 2**40, 0.0, 0.0, 0.0, 1.0, 0, [], -1, -1)
    for length in (5, 7, 13, 15):
        raw[4][0] = (msgpack.unpackb(encode(Command(step=0, admits=[_admit()])))[4][0] + [0])[:length]
        with pytest.raises(ProtocolError, match="admit must be"):
            decode(msgpack.packb(raw), LIMITS)


def _full_state(**changes) -> FullState:
    b, mb = LIMITS.max_batch_size, LIMITS.max_blocks_per_row
    fields = dict(positions=np.zeros(b, np.int64), active=np.zeros(b, bool), block_table=np.zeros((b, mb), np.int32),
                  slot_mapping=np.zeros(b, np.int64), temperature=np.zeros(b, np.float32),
                  top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int64), seed_keys=np.zeros(b, np.int64))
    fields.update(changes)
    return FullState(**fields)


def test_full_state_carries_the_sampling_parameters() -> None:
    neutral = decode(encode(Command(step=1, full_state=_full_state())), LIMITS).full_state
    assert neutral.repetition_penalty.tolist() == [1.0] * 4 and neutral.logprobs.tolist() == [-1] * 4
    assert neutral.stop_ids.shape == (4, 0)
    stop_ids = np.array([[5, 6, -1], [-1, -1, -1], [299, -1, -1], [0, 1, 2]], np.int32)
    sent = _full_state(min_p=np.array([0, 0.5, 1, 0], np.float32), presence_penalty=np.full(4, -2, np.float32),
                       frequency_penalty=np.full(4, 2, np.float32), repetition_penalty=np.full(4, 1.5, np.float32),
                       min_tokens=np.array([0, 3, 32, 1]), prompt_lens=np.array([1, 5, 31, 0]),
                       logprobs=np.array([-1, 0, 20, 5]), stop_ids=stop_ids)
    got = decode(encode(Command(step=1, full_state=sent)), LIMITS).full_state
    for name, _ in FullState._FIELDS:
        assert np.array_equal(getattr(got, name), getattr(sent, name)), name


@pytest.mark.parametrize("changes, message", [
    (dict(min_p=np.full(4, 1.5, np.float32)), "full_state.min_p"),
    (dict(presence_penalty=np.full(4, np.nan, np.float32)), "full_state.presence_penalty"),
    (dict(repetition_penalty=np.zeros(4, np.float32)), "full_state.repetition_penalty"),
    (dict(min_tokens=np.full(4, -1)), "full_state.min_tokens"),
    (dict(prompt_lens=np.full(4, 32)), "full_state.prompt_lens"),
    (dict(logprobs=np.full(4, 21)), "full_state.logprobs"),
    (dict(stop_ids=np.full((4, 1), 300, np.int32)), "full_state.stop_ids"),
    (dict(stop_ids=np.full((4, 1), -2, np.int32)), "full_state.stop_ids"),
    (dict(stop_ids=np.zeros(5, np.int32)), "full_state.stop_ids: expected a multiple"),
    (dict(min_p=np.zeros(3, np.float32)), "full_state.min_p: expected 4"),
])
def test_malformed_full_state_sampling_fields_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(encode(Command(step=1, full_state=_full_state(**changes))), LIMITS)


def test_logprob_limits_and_ring_shapes_agree() -> None:
    from l3worker.params import MAX_LOGPROBS
    from l3worker.worker.shared_buffers import StepBuffers

    from chip_child.step import task_args

    assert row_fields.MAX_LOGPROBS == task_args.MAX_LOGPROBS == MAX_LOGPROBS == 20
    ring = StepBuffers.create(slots=3, max_batch_size=5, prefill_capacity=40)
    expected = {"logprobs": ((3, 5, 21), torch.float32), "logprob_ids": ((3, 5, 20), torch.int32),
                "prompt_logprobs": ((3, 40, 21), torch.float32), "prompt_logprob_ids": ((3, 40, 20), torch.int32)}
    for name, (shape, dtype) in expected.items():
        tensor = getattr(ring, name)
        assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), name
        assert ring.specs[name].shape == shape
    local = StepOutputs.allocate(5, 40)
    for name, (shape, dtype) in expected.items():
        assert (tuple(getattr(local, name).shape), getattr(local, name).dtype) == (shape[1:], dtype), name


# -- the child writes the ring -----------------------------------------------------------------------

def test_chip_child_writes_logprobs_into_the_step_slot(ckpt: Path) -> None:
    import zmq

    from l3worker.worker.child_process import ChildProcess, child_spec
    from l3worker.worker.shared_buffers import StepBuffers

    cfg = RuntimeConfig(str(ckpt), device="cpu", dtype="float32", max_batch_size=2, max_seq_len=32, page_size=4,
                        num_threads=1)
    ring = StepBuffers.create(slots=3, max_batch_size=2, prefill_capacity=cfg.prefill_capacity)
    reqs = [LocalRequest([5, 6, 7, 8, 9], 3, temperature=0.7, seed=3, logprobs=4, prompt_logprobs=2,
                         presence_penalty=0.5),
            LocalRequest([1, 2, 3], 3)]
    want = LocalDriver(make_runtime(ckpt, batch=2)).run(reqs)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as socket_dir:
        child = ChildProcess(ctx, child_spec(0, cfg, ring, socket_dir, wake_every_step=True), ring)
        try:
            child.wait_ready(120)
            staging = np.array(reqs[0].prompt + reqs[1].prompt, np.int32)
            ring.staging[0, :len(staging)] = torch.from_numpy(staging)
            admits = [(Admit(0, 5, 0.7, 1.0, 0, 3, presence_penalty=0.5, logprobs=4, prompt_logprobs=2),
                       np.array([1, 2], np.int32), 0),
                      (Admit(1, 3, 0.0, 1.0, 0, 0), np.array([3], np.int32), 5)]
            # Row 1's third token needs its second page (position 4).
            commands = [prefill_command(0, admits), Command(1), Command(2, new_pages=np.array([[1, 1, 4]], np.int32))]
            for cmd in commands:
                child.send(encode(cmd))
                deadline = time.monotonic() + 60
                while ring.doorbell[0] <= cmd.step:
                    child.check_alive(f"step {cmd.step}")
                    assert time.monotonic() < deadline, "the child did not complete the step"
                    time.sleep(0.001)
                slot = cmd.step % 3
                assert ring.sampled[slot].tolist() == [want.token_ids[0][cmd.step], want.token_ids[1][cmd.step]]
                got = want.logprobs[0][cmd.step]
                assert ring.logprobs[slot, 0, 0].item() == pytest.approx(got.logprob, abs=1e-5)
                assert ring.logprob_ids[slot, 0, :4].tolist() == got.top_ids
                assert np.allclose(ring.logprobs[slot, 0, 1:5].tolist(), got.top_logprobs, atol=1e-5)
            for j, got in enumerate(want.prompt_logprobs[0]):
                assert ring.prompt_logprobs[0, j, 0].item() == pytest.approx(got.logprob, abs=1e-5)
                assert ring.prompt_logprob_ids[0, j, :2].tolist() == got.top_ids
        finally:
            child.stop()
            ctx.term()
    assert not os.path.exists(child.socket_path)
