"""Structured outputs through the engine and the chip-child, on the built-in random-weight model:
valid output on every sampler path, unconstrained rows untouched, log-probabilities of the masked
distribution, termination without eos, preemption, copy_policy="always", and the reasoning start."""
from __future__ import annotations

import json
import math
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest

from l3worker import DistributedWorker, SamplingParams
from l3worker.engine.grammar_gate import GrammarGate
from l3worker.structured.specs import StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["a", "bb"]}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "kind", "ok"],
    "additionalProperties": False,
}
JSON = {"json": SCHEMA}
PATHS = {  # every sampler path, each with the constraint
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=3),
    "filtered": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=4),
    "penalties": dict(temperature=1.0, seed=5, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    "logprobs": dict(temperature=1.0, seed=6, logprobs=5),
}
WORKER = dict(max_batch_size=4, max_seq_len=256, page_size=16)


@pytest.fixture(scope="module")
def worker():
    with DistributedWorker(**WORKER) as w:
        yield w


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 100, "temperature": 0.0, "structured_outputs": JSON, **kw})


@pytest.mark.parametrize("path", PATHS)
def test_every_sampler_path_writes_schema_valid_json(worker, path) -> None:
    outs = worker.generate(["Hello", "A", "xyz", "Q:"], [params(**PATHS[path])] * 4)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_many_seeds_always_valid(worker) -> None:
    outs = worker.generate(["Hi"] * 12, [params(temperature=1.0, seed=s) for s in range(12)])
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_unconstrained_rows_are_untouched_by_a_constrained_one(worker) -> None:
    free = SamplingParams(max_new_tokens=20, temperature=0.9, seed=1, ignore_eos=True)
    alone = worker.generate(["one", "two", "three"], [free] * 3)
    mixed = worker.generate(["one", "two", "three", "four"], [free] * 3 + [params(temperature=1.0, seed=2)])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[3].text), SCHEMA)


def test_logprobs_are_those_of_the_masked_distribution(worker) -> None:
    choices = ["yes", "no"]
    o = worker.generate(["Hi"], [params(structured_outputs={"choice": choices}, temperature=1.0, seed=0,
                                        logprobs=5)])[0]
    assert o.text in choices and o.finish_reason == "stop"
    first = o.outputs[0].logprobs[0]
    allowed = {ord("y"), ord("n")}  # the tiny model's tokens are bytes
    finite = {t for t, v in first.top if math.isfinite(v)}
    assert finite == allowed and first.token_id in allowed
    assert math.isclose(sum(math.exp(v) for t, v in first.top if t in allowed), 1.0, rel_tol=1e-4)


def test_the_grammar_ends_the_reply_without_eos(worker) -> None:
    regex = r"[a-d]{3}"
    outs = worker.generate(["x"] * 3, [params(structured_outputs={"regex": regex}, ignore_eos=True, temperature=1.0,
                                              seed=s) for s in range(3)])
    for o in outs:
        assert re.fullmatch(regex, o.text) and o.finish_reason == "stop" and len(o.token_ids) == 3


def test_grammar_applies_after_the_reasoning_end_token(worker) -> None:
    free = worker.generate(["Hi"], [SamplingParams(temperature=0.0, max_new_tokens=1)])[0].token_ids[0]
    o = worker.generate(["Hi"], [params(structured_outputs={"regex": "[0-9]{2}"}, reasoning_end_token_id=free)])[0]
    assert o.token_ids[0] == free  # unconstrained until that token: greedy gives it first
    assert re.fullmatch("[0-9]{2}", worker.engine.tokenizer.decode(o.token_ids[1:])), o.text


def test_preempted_constrained_request_resumes_identically() -> None:
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(4)]
    ps = [params(temperature=1.0, seed=s, max_new_tokens=120) for s in range(4)]
    with DistributedWorker(**WORKER) as w:
        roomy = w.generate(prompts, ps)
    with DistributedWorker(**{**WORKER, "num_pages": 10}) as w:
        tight = w.generate(prompts, ps)
        assert w.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for o in tight:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_copy_policy_always_and_overlap_give_the_same_tokens(worker) -> None:
    ps = [params(temperature=1.0, seed=s) for s in range(3)] + [SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)]
    want = [o.token_ids for o in worker.generate(["a", "b", "c", "d"], ps)]
    for kw in ({"copy_policy": "always"}, {"overlap_steps": True}):
        with DistributedWorker(**WORKER, **kw) as w:
            assert [o.token_ids for o in w.generate(["a", "b", "c", "d"], ps)] == want, kw


def test_invalid_offline_constraints_name_the_field(worker) -> None:
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        SamplingParams(temperature=0.0, structured_outputs={"regex": "(a"})
    with pytest.raises(ValueError, match="structured_outputs.json"):
        SamplingParams(temperature=0.0, structured_outputs={"json": {"type": 5}})
    with pytest.raises(TypeError, match="structured_outputs"):
        worker.generate(["x"], [SamplingParams(temperature=0.0, structured_outputs="json")])
    spec = StructuredSpec.from_request(guided_choice=["a", "b"])
    assert worker.generate(["x"], [SamplingParams(temperature=0.0, structured_outputs=spec)])[0].text in ("a", "b")


def test_gate_holds_a_request_until_its_grammar_compiled() -> None:
    woken = []
    gate = GrammarGate(lambda: woken.append(1))

    class State:  # what the gate reads of a RequestState
        finished = all_finished = False
        grammar: Future = Future()

    s = State()
    assert gate.hold(s) and gate and gate.release() == []
    s.grammar.set_result(None)
    assert woken == [1] and gate.release() == [s] and not gate


def test_a_token_the_grammar_refuses_fails_the_request_never_stops_it(worker, monkeypatch) -> None:
    # The child masks by "hello world", while the parent's shadow matcher follows "hello there":
    # the two agree on the first tokens, then the child lets through what the shadow refuses, as
    # a child whose matcher broke mid-stream would. That is an error, not a normal "stop".
    grammars = worker.engine.input_processor.grammars
    submit = grammars.submit
    monkeypatch.setattr(grammars, "submit", lambda spec: submit(StructuredSpec.of({"choice": ["hello there"]})))
    failures = worker.engine.metrics.value("l3worker:structured_output_failures_total")
    constrained = params(temperature=0.0, structured_outputs={"choice": ["hello world"]})
    out, untouched = worker.generate(["Hi", "Hi"], [constrained, SamplingParams(temperature=0.0, max_new_tokens=20)])
    assert out.finish_reason == "abort" and out.error is not None
    assert "the grammar refused token" in out.error
    assert out.text.startswith("hello") and len(out.token_ids) >= 2  # it failed mid-stream, not at the start
    assert untouched.error is None and untouched.finish_reason == "length"
    assert worker.engine.metrics.value("l3worker:structured_output_failures_total") == failures + 1


def test_close_ends_the_grammar_compile_threads() -> None:
    def compile_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("grammar")]

    before = set(compile_threads())
    w = DistributedWorker(**WORKER)
    with w:
        w.generate(["Hi"], params(temperature=0.0, max_new_tokens=30))
        assert set(compile_threads()) - before  # the engine's compiler pool ran the request's grammar
    assert not set(compile_threads()) - before


def test_prepare_returns_with_the_parents_token_trie_built(monkeypatch) -> None:
    """The parent builds its compiler's trie while its children start, and prepare() waits for it:
    built at the first constrained request instead, it would hold the interpreter lock, and so the
    step loop, for the whole build under traffic."""
    from chip_child.sampling import grammar

    built: list[int] = []
    real = grammar.llguidance.LLTokenizer

    def counting(*args, **kwargs):
        built.append(threading.get_native_id())
        return real(*args, **kwargs)

    monkeypatch.setattr(grammar.llguidance, "LLTokenizer", counting)
    with DistributedWorker(**WORKER) as w:
        compiler = w.engine.input_processor.grammars._compiler
        assert compiler is not None and compiler._tokenizer is not None and len(built) == 1
        w.generate(["Hi"], params(max_new_tokens=8))
        assert len(built) == 1  # the request's compile used it
