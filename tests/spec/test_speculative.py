"""Speculative decoding (ngram, draft model): tokens identical to plain decoding, greedy and seeded, through real
chip-children, across batch compositions, chunked prefill, preemption, pipeline depths and a
restart; rows asking for log-probabilities speculate with plain decoding's values, one entry per
token; drafts accepted where the text repeats; counts that add up; refusals."""
from __future__ import annotations

import pytest

from chip_child.spec.config import SpeculativeConfig
from l3worker import DistributedWorker, SamplingParams
from spec_helpers import LP_PARAMS, LP_PROMPTS, LP_ROWS, PARAMS, PROMPTS, SMALL, _check_counts, _tokens
from scripted_model import EOS_TOKEN, TOOL_CHAIN, _ids, build_tokenizer, write_scripted_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _logprobs(out) -> list[tuple]:
    """A sample's log-probabilities: (token, value, top ids, top values) per position."""
    return [(lp.token_id, lp.logprob, [i for i, _ in lp.top], [v for _, v in lp.top]) for lp in out.outputs[0].logprobs]


def _assert_same_logprobs(got: list[tuple], want: list[tuple]) -> None:
    """The same tokens and top ids; values equal up to float32 rounding (1e-6 relative, a few units
    in the last place of a value near -25; 1e-5 absolute near 0), since a verify step's forward
    (another shape, through the chunk attention path, which BLAS may block differently) rounds
    differently from a plain step's; the sampled tokens are the same ones."""
    assert [(t, ids) for t, _, ids, _ in got] == [(t, ids) for t, _, ids, _ in want]
    assert [[v, *top] for _, v, _, top in got] == [pytest.approx([v, *top], rel=1e-6, abs=1e-5)
                                                   for _, v, _, top in want]


@pytest.mark.parametrize("options", [
    {},  # run-ahead (pipeline_depth 2)
    {"pipeline_depth": 1},
    {"max_num_batched_tokens": 8},  # every prompt prefilled in chunks beside decoding rows
    {"num_pages": 14, "enable_prefix_caching": False},  # too few pages: rows are preempted and resumed
    {"stream_interval": 3},  # three verify steps read per wake-up
], ids=["depth2", "depth1", "chunked", "preempted", "grouped"])
def test_ngram_tokens_identical_to_plain_decoding(plain, options) -> None:
    with DistributedWorker(**SMALL, speculative_config=NGRAM, **options) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        s = _check_counts(w)
        assert s["num_accepted_tokens"] > 0  # the repeating rows accept drafts
        if "max_num_batched_tokens" in options:  # steps carrying a prompt chunk decode their rows plainly
            assert s["num_undrafted_tokens"] > 0
        if "num_pages" in options:
            assert w.engine.scheduler.num_preemptions > 0
        stats = w.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        # Generated tokens the parent took in: at least the accepted ones beyond one a step.
        assert w.engine.metrics.value("l3worker:generation_tokens_total") == sum(len(t) for t in plain)


@pytest.mark.parametrize("depth", [1, 2])
def test_copy_policy_always_gives_the_plain_tokens(plain, depth) -> None:
    """The full state rebuilt each step leaves positions and slots to the device, which moves them
    by acceptance: run-ahead or not, the tokens are plain decoding's and drafts are accepted."""
    with DistributedWorker(**SMALL, speculative_config=NGRAM, copy_policy="always", pipeline_depth=depth) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        assert _check_counts(w)["num_accepted_tokens"] > 0


def test_penalized_and_grammar_rows_fall_back_alone(tmp_path) -> None:
    """A penalized row and one held to a grammar get no drafts, and the greedy row and a seeded
    row asking for log-probabilities beside them speculate: tokens and log-probabilities are
    plain decoding's. The chain's logit dwarfs every other, so every draft is accepted."""
    model = write_scripted_model(tmp_path / "scripted")
    tok = build_tokenizer()
    chain = _ids(tok, TOOL_CHAIN) + [tok.token_to_id(EOS_TOKEN)]
    prompt = [10, *chain, 10]
    n = len(chain)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0),
              SamplingParams(max_new_tokens=n, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_new_tokens=n, temperature=0.7, seed=3, logprobs=3),
              SamplingParams(max_new_tokens=n, temperature=0.0, structured_outputs={"choice": ["Paris", "Rome"]})]

    with DistributedWorker(model, **SMALL) as w:
        expected = w.generate([prompt] * 4, params)
    assert _tokens(expected)[0] == chain and len(_logprobs(expected[2])) == n
    assert expected[3].outputs[0].text in ("Paris", "Rome")
    with DistributedWorker(model, **SMALL, speculative_config=NGRAM) as w:
        outs = w.generate([prompt] * 4, params)
        assert _tokens(outs) == _tokens(expected)
        _assert_same_logprobs(_logprobs(outs[2]), _logprobs(expected[2]))
        s = _check_counts(w)
        assert s["num_accepted_tokens"] > 0 and s["num_accepted_tokens"] == s["num_draft_tokens"]


def test_min_p_and_min_tokens_rows_speculate(tmp_path) -> None:
    """min_p and min_tokens' stop mask apply position by position: a row using both drafts, and
    accepts, with plain decoding's tokens (the chain's logit dwarfs every other, so a seeded draw
    follows it)."""
    model = write_scripted_model(tmp_path / "scripted")
    tok = build_tokenizer()
    chain = _ids(tok, TOOL_CHAIN) + [tok.token_to_id(EOS_TOKEN)]
    params = SamplingParams(max_new_tokens=len(chain), temperature=0.7, seed=4, min_p=0.1, min_tokens=3)
    with DistributedWorker(model, **SMALL) as w:
        (expected,) = w.generate([[10, *chain, 10]], params)
    with DistributedWorker(model, **SMALL, speculative_config=NGRAM) as w:
        (out,) = w.generate([[10, *chain, 10]], params)
        assert list(out.outputs[0].token_ids) == list(expected.outputs[0].token_ids) == chain
        assert _check_counts(w)["num_accepted_tokens"] > 0


def test_batch_compositions_and_a_second_call(plain) -> None:
    """Each request alone, then all of them again: the same tokens whatever shares the batch."""
    with DistributedWorker(**SMALL, speculative_config=NGRAM) as w:
        for i in (0, 1, 4):
            assert _tokens(w.generate([PROMPTS[i]], [PARAMS[i]])) == [plain[i]]
        assert _tokens(w.generate(PROMPTS[:4], PARAMS[:4])) == plain[:4]


def test_logprobs_stop_strings_and_streams_see_exactly_the_plain_tokens() -> None:
    """A row asking for log-probabilities beside other speculating ones, n=2
    samples, a stop string on the built-in model's text, and a stream whose deltas add up."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    params = [SamplingParams(max_new_tokens=20, temperature=0.0, logprobs=2),
              SamplingParams(max_new_tokens=18, temperature=0.8, seed=2, n=2),
              SamplingParams(max_new_tokens=24, temperature=0.0, stop=["a"])]

    def run(w: DistributedWorker):
        outs = w.generate(prompts, params)
        samples = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]
        logprobs = _logprobs(outs[0])
        streamed: dict[tuple, list[int]] = {}
        for out in w.stream(prompts[1:], params[1:]):
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.delta_token_ids)
        return samples, logprobs, sorted(streamed.values())

    with DistributedWorker(**SMALL) as w:
        expected = run(w)
    with DistributedWorker(**SMALL, speculative_config=NGRAM) as w:
        samples, logprobs, streamed = run(w)
        assert (samples, streamed) == (expected[0], expected[2])
        _assert_same_logprobs(logprobs, expected[1])
        assert w.stats()["speculative"]["num_accepted_tokens"] > 0
    assert sorted(t for t, *_ in expected[0][1:]) == expected[2]  # the stream's deltas are the final tokens


def _samples(outs) -> list[tuple[list[int], list[tuple] | None]]:
    """Each request's first sample: its tokens and, when it asked, its log-probabilities."""
    return [(list(o.outputs[0].token_ids), None if o.outputs[0].logprobs is None else _logprobs(o)) for o in outs]


def _assert_plain_samples(outs, expected: list[tuple[list[int], list[tuple] | None]]) -> None:
    """Plain decoding's tokens, and one log-probability entry per token, plain decoding's."""
    for (tokens, lps), (want_tokens, want_lps) in zip(_samples(outs), expected, strict=True):
        assert tokens == want_tokens
        assert (lps is None) == (want_lps is None)
        if lps is not None:
            assert len(lps) == len(tokens) == len(want_lps)
            _assert_same_logprobs(lps, want_lps)


@pytest.fixture(scope="module")
def plain_logprobs() -> list[tuple[list[int], list[tuple] | None]]:
    """The log-probability workload (spec_helpers) decoded without speculation."""
    with DistributedWorker(**SMALL) as w:
        return _samples(w.generate(LP_PROMPTS, LP_PARAMS))


@pytest.mark.parametrize("method, options", [
    ("ngram", {}),
    ("ngram", {"pipeline_depth": 1}),
    ("ngram", {"max_num_batched_tokens": 8}),
    ("ngram", {"num_pages": 14, "enable_prefix_caching": False}),
    ("ngram", {"copy_policy": "always"}),
    ("draft_model", {}),
    ("draft_model", {"pipeline_depth": 1, "copy_policy": "always"}),
    ("draft_model", {"device_ids": (0, 1)}),  # rank 0 alone computes log-probabilities
], ids=["ngram-depth2", "ngram-depth1", "ngram-chunked", "ngram-preempted", "ngram-always", "draft-depth2",
        "draft-depth1-always", "draft-tp2"])
def test_logprob_rows_speculate_with_plain_tokens_and_logprobs(plain_logprobs, method, options) -> None:
    """Rows asking for log-probabilities (greedy and seeded, beside a plain row and a penalized
    one) verify drafts, and give plain decoding's tokens with one entry per token, plain
    decoding's. Run alone, those rows accept drafts: rows that fell back would verify none (a
    draft model equal to the target accepts every draft, so every position is exercised)."""
    from chip_child.models.tiny_model import ensure_tiny_model

    config = NGRAM if method == "ngram" else _draft(ensure_tiny_model())
    with DistributedWorker(**SMALL, speculative_config=config, **options) as w:
        _assert_plain_samples(w.generate(LP_PROMPTS, LP_PARAMS), plain_logprobs)
        before = _check_counts(w)
        outs = w.generate([LP_PROMPTS[i] for i in LP_ROWS], [LP_PARAMS[i] for i in LP_ROWS])
        _assert_plain_samples(outs, [plain_logprobs[i] for i in LP_ROWS])
        s = _check_counts(w)
        drafted = s["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = s["num_accepted_tokens"] - before["num_accepted_tokens"]
        assert accepted > 0
        if method == "draft_model":
            assert accepted == drafted
        if "num_pages" in options:
            assert w.engine.scheduler.num_preemptions > 0


def test_streamed_logprobs_come_one_per_token(plain_logprobs) -> None:
    """A stream's deltas carry as many log-probability entries as tokens, even when a step gave
    a row several tokens; together they are plain decoding's."""
    prompts = [LP_PROMPTS[i] for i in LP_ROWS]
    with DistributedWorker(**SMALL, speculative_config=NGRAM) as w:
        tokens: dict[int, list[int]] = {}  # per prompt's index
        entries: dict[int, list] = {}
        for out in w.stream(prompts, [LP_PARAMS[i] for i in LP_ROWS]):
            (c,) = out.outputs
            assert len(c.delta_logprobs) == len(c.delta_token_ids)
            i = prompts.index(list(out.prompt_token_ids))
            tokens.setdefault(i, []).extend(c.delta_token_ids)
            entries.setdefault(i, []).extend(c.delta_logprobs)
        assert w.stats()["speculative"]["num_accepted_tokens"] > 0
    for i, row in enumerate(LP_ROWS):
        want_tokens, want_lps = plain_logprobs[row]
        assert tokens[i] == want_tokens
        _assert_same_logprobs([(lp.token_id, lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])
                               for lp in entries[i]], want_lps)


def test_the_openai_server_gives_one_logprob_entry_per_token(plain_logprobs) -> None:
    """/v1/completions, whole and streamed, on a speculating worker: one entry per completion
    token, plain decoding's values."""
    import httpx

    from l3worker.serving.runner import ServeOptions, ServerThread
    from server_helpers import metric, sse_events, stream_raw

    row = LP_ROWS[0]
    p = LP_PARAMS[row]
    body = {"model": "l3worker-tiny", "prompt": LP_PROMPTS[row], "max_tokens": p.max_new_tokens, "temperature": 0,
            "logprobs": p.logprobs, "min_tokens": p.min_tokens, "stop_token_ids": list(p.stop_token_ids)}
    want_tokens, want = plain_logprobs[row]
    with ServerThread(DistributedWorker(**SMALL, speculative_config=NGRAM), options=ServeOptions(port=0)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert r.json()["usage"]["completion_tokens"] == len(lp["token_logprobs"]) == len(want_tokens)
        _, raw = stream_raw(http, "/v1/completions", {**body, "stream": True})
        streamed = [v for e in sse_events(raw)[:-1] for c in e["choices"] if c["logprobs"]
                    for v in c["logprobs"]["token_logprobs"]]
        drafted = metric(http, "l3worker:spec_decode_num_accepted_tokens_total")
    assert drafted > 0
    assert lp["token_logprobs"] == pytest.approx([v for _, v, _, _ in want], abs=1e-5)
    assert streamed == pytest.approx([v for _, v, _, _ in want], abs=1e-5)


def test_restart_mid_speculation_resumes_identically(plain) -> None:
    with DistributedWorker(**SMALL, speculative_config=NGRAM, fault_injection="verify:exit@3") as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        assert w.engine.metrics.value("l3worker:engine_restarts_total") == 1


def test_a_text_that_repeats_accepts_every_draft(tmp_path) -> None:
    """The scripted bigram model writes a known chain after "\\n"; a prompt that already holds the
    chain gives drafts that are all the target's tokens."""
    model = write_scripted_model(tmp_path / "scripted")
    tok = build_tokenizer()
    chain = _ids(tok, TOOL_CHAIN) + [tok.token_to_id(EOS_TOKEN)]
    prompt = [10, *chain, 10]
    params = SamplingParams(max_new_tokens=len(chain), temperature=0.0)
    with DistributedWorker(model, **SMALL, speculative_config=NGRAM) as w:
        for _ in range(2):  # the second time, its prompt's first pages come from the prefix cache
            before = w.stats()["speculative"]
            (out,) = w.generate([prompt], params)
            assert list(out.outputs[0].token_ids) == chain
            s = _check_counts(w)
            drafted = s["num_draft_tokens"] - before["num_draft_tokens"]
            assert drafted > 0 and s["num_accepted_tokens"] - before["num_accepted_tokens"] == drafted
            assert s["mean_accepted_length"] > 2
        assert out.num_cached_tokens > 0


# -- draft_model ------------------------------------------------------------------------------------------

def _draft(model) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


@pytest.mark.parametrize("options", [{}, {"num_pages": 14, "enable_prefix_caching": False}],
                         ids=["depth2", "preempted"])
def test_a_draft_model_equal_to_the_target_accepts_every_draft(plain, options) -> None:
    from chip_child.models.tiny_model import ensure_tiny_model

    with DistributedWorker(**SMALL, speculative_config=_draft(ensure_tiny_model()), **options) as w:
        for _ in range(2):  # with prefix caching on, the second call's prompts hit the cache
            assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
            s = _check_counts(w)
            assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] == s["num_draft_tokens"]


def test_tensor_parallel_ranks_agree_on_every_draft(plain) -> None:
    """Two ranks draft, verify and accept alike (each from its own shard's forward)."""
    from chip_child.models.tiny_model import ensure_tiny_model

    with DistributedWorker(**SMALL, device_ids=(0, 1), speculative_config=_draft(ensure_tiny_model())) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        s = _check_counts(w)
        assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] == s["num_draft_tokens"]


@pytest.mark.parametrize("options", [{"pipeline_depth": 1}, {"max_num_batched_tokens": 8}],
                         ids=["depth1", "chunked"])
def test_another_draft_model_gives_the_plain_tokens(plain, make_checkpoint, options) -> None:
    draft = make_checkpoint("spec-draft", seed=5, vocab_size=320, num_hidden_layers=1)
    with DistributedWorker(**SMALL, speculative_config=_draft(draft), **options) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        s = _check_counts(w)
        assert s["num_draft_tokens"] > s["num_accepted_tokens"]  # a random draft: some are rejected


def test_a_draft_model_of_another_vocabulary_is_refused(make_checkpoint) -> None:
    draft = make_checkpoint("spec-draft-300", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300 differs from the target's 320"):
        DistributedWorker(**SMALL, speculative_config=_draft(draft))


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "mtp", "model": "x", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "applies to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key(s) ['lookahead']"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused_by_name(config, message) -> None:
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.of(config)
    assert message in str(e.value)


def test_lookup_bounds_default_as_vllm() -> None:
    one = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    none = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2})
    assert (none.prompt_lookup_min, none.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize("options, message", [
    ({"decode_graphs": True}, "decode_graphs=True"),
    ({"overlap_steps": True}, "overlap_steps=True"),
])
def test_unsupported_combinations_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        DistributedWorker(**SMALL, speculative_config=NGRAM, **options)


def test_serve_flag_checks_its_json(capsys) -> None:
    from l3worker.serving.cli import build_parser, main

    flag = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(["serve", "--speculative-config", flag])
    assert args.speculative_config["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative-config", '{"method": "ngram", "k": 2}'])
    assert e.value.code == 2 and "unknown key(s) ['k']" in capsys.readouterr().err


def test_a_draft_models_catch_up_stays_within_the_steps_token_budget() -> None:
    """Two 4-token prompts prefilled in one step of an 8-token budget: the first proposal catches
    up 5 + 5 positions, more than the budget, so one row catches up 3 and drafts nothing that
    step, and the next proposal finishes it. A row admitted over a prefix-cache hit keeps the
    draft K/V of the cached positions."""
    import numpy as np
    import torch

    from chip_child.config import RuntimeConfig
    from chip_child.local import LocalRequest, _row_values
    from chip_child.models.tiny_model import ensure_tiny_model
    from chip_child.protocol import Admit, prefill_command
    from chip_child.step.results import StepOutputs
    from chip_child.step.runtime import ChipRuntime

    model = str(ensure_tiny_model())
    rt = ChipRuntime(RuntimeConfig(model, device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64,
                                   page_size=8, max_prefill_tokens=8, decode_graphs=False,
                                   speculative=_draft(model)))
    draft = rt.spec.draft
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    admits = [(Admit(i, **_row_values(LocalRequest(p, 8))), np.array([1 + i], np.int32), 4 * i)
              for i, p in enumerate(prompts)]
    staging = np.array(prompts[0] + prompts[1], np.int32)
    rt.execute(prefill_command(0, admits), staging, torch.zeros(2, dtype=torch.int32), StepOutputs.allocate(2, 8))
    rows, pos, room = np.array([0, 1]), np.array([4, 4]), np.array([3, 3])
    with torch.inference_mode():  # as the runtime's step calls it
        _, counts = draft.propose(rows, pos, room, rt.spec.history, False, False)
        assert draft.catch_up_tokens == 8 and counts.tolist() == [3, 0] and draft.valid[1] == 3
        _, counts = draft.propose(np.array([1]), np.array([4]), np.array([3]), rt.spec.history, False, False)
        assert draft.catch_up_tokens == 2 and counts.tolist() == [3]
    with torch.inference_mode():
        rt.spec.admitted([Admit(0, **{**_row_values(LocalRequest(prompts[0], 8)), "cached_ids": np.arange(8)})])
    assert draft.valid[0] == 8
    rt.close()


@pytest.mark.parametrize("seed", range(3))
def test_the_incremental_ngram_index_proposes_what_the_whole_history_lookup_does(seed: int) -> None:
    """Histories fed token by token, in chunks of any size, each checked after every token
    against the lookup recomputed over the whole history."""
    import numpy as np
    import torch

    from chip_child.spec.ngram import NgramIndex
    from spec_helpers import ngram_drafts_reference

    rng = np.random.default_rng(seed)
    rows, length, k, lo, hi = 6, 60, 4, 1, 3
    histories = rng.integers(0, 5, (rows, length))  # a small alphabet: n-grams recur often
    histories[0, 30:] = histories[0, :30]  # and a row that repeats its first half
    index = NgramIndex(rows, length, lo, hi)
    for row in range(rows):
        at = 0
        while at < length:
            size = int(rng.integers(1, 6))
            index.put(row, at, histories[row, at:at + size])
            at = min(at + size, length)
            want_d, want_n = ngram_drafts_reference(torch.from_numpy(histories[row:row + 1, :at]),
                                                    torch.tensor([at]), k, lo, hi)
            got = index.propose(row, k)
            assert got.tolist() == want_d[0, :int(want_n[0])].tolist(), (row, at)
    index.reset(2)
    assert index.propose(2, k).tolist() == [] and index.length[2] == 0
