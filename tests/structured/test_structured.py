"""Structured outputs: request fields -> spec, and a random-logit "model" sampled under the masks
always produces text that the constraint accepts."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from chip_child.config import RuntimeConfig
from chip_child.models.tiny_model import ensure_tiny_model
from chip_child.sampling import grammar
from chip_child.sampling.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from chip_child.sampling.grammar_rows import ConstrainedRows
from chip_child.step.runtime import ChipRuntime
from l3worker.structured.specs import StructuredSpec, tool_choice_spec
from l3worker.structured.tool_parsers import parse_tool_calls
from schemas import SCHEMA



class Vocab:
    """A tokenizer as the server has it: tokenizer.json, the model's (padded) vocab size, eos."""

    def __init__(self, path: Path, vocab_size: int, eos: int) -> None:
        self.path, self.vocab_size, self.eos = path, vocab_size, eos
        self.tok = Tokenizer.from_file(str(path))
        self.n_tokens = self.tok.get_vocab_size(with_added_tokens=True)
        self.tags_are_tokens = self.tok.token_to_id("<tool_call>") is not None


def _tiny() -> Vocab:
    d = ensure_tiny_model()
    cfg = json.loads((d / "config.json").read_text())
    return Vocab(d / "tokenizer.json", cfg["vocab_size"], cfg["eos_token_id"])


def _trained_bpe(tmp: Path) -> Vocab:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": f"user{i}", "age": i, "role": "admin" if i % 2 else "user",
                          "tags": ["a", "bc"], "ok": True}) for i in range(200)]
    corpus += ["hello world, the quick brown fox " * 4, "<tool_call>\n{}\n</tool_call>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken("<tool_call>", normalized=False), AddedToken("</tool_call>", normalized=False)])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    n = tok.get_vocab_size(with_added_tokens=True)
    return Vocab(path, n + 37, tok.token_to_id("<|endoftext|>"))  # the model pads its vocab


@pytest.fixture(scope="module", params=["tiny", "bpe"])
def vocab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Vocab:
    return _tiny() if request.param == "tiny" else _trained_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def compiler(vocab: Vocab):
    with GrammarCompiler(vocab.path, vocab.vocab_size, [vocab.eos]) as c:
        yield c


def sample(compiler: GrammarCompiler, vocab: Vocab, spec: StructuredSpec, seed: int) -> str:
    """Random logits each step, masked, sampled; stops when the grammar terminates."""
    gen = torch.Generator().manual_seed(seed)
    matcher = compiler.submit(spec).result().matcher()
    mask = allocate_bitmask(1, vocab.vocab_size)
    ids: list[int] = []
    for _ in range(3000):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(mask[0])
        logits = torch.randn(1, vocab.vocab_size, generator=gen)
        apply_bitmask(logits, mask)
        assert torch.isinf(logits[0, vocab.n_tokens:]).all()  # padding ids are never allowed
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept(token), matcher.error
        ids.append(token)
    else:
        pytest.fail("grammar did not terminate")
    return vocab.tok.decode([t for t in ids if t != vocab.eos], skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_sampling_always_validates(compiler: GrammarCompiler, vocab: Vocab, seed: int) -> None:
    spec = StructuredSpec.from_request(response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(sample(compiler, vocab, spec, seed)), SCHEMA)


def test_json_object_sampling_is_an_object(compiler: GrammarCompiler, vocab: Vocab) -> None:
    # any object: keep the random walk short by accepting the first few complete samples
    spec = StructuredSpec.from_request(response_format={"type": "json_object"})
    assert spec.kind == "json_object"
    compiled = compiler.compile(spec)
    matcher = compiled.matcher()
    for token in vocab.tok.encode('{"a": [1, {"b": null}]}').ids:
        assert matcher.accept(token)
    assert matcher.is_terminated()
    bad = compiled.matcher()
    assert not bad.accept(vocab.tok.encode("[").ids[0]) and bad.error  # an array is not an object


@pytest.mark.parametrize("seed", range(4))
def test_regex_choice_and_grammar_sampling(compiler: GrammarCompiler, vocab: Vocab, seed: int) -> None:
    regex = r"[a-c]{2,4}-[0-9]{1,3}"  # \\d is Unicode in both, but of different Unicode versions
    out = sample(compiler, vocab, StructuredSpec.from_request(structured_outputs={"regex": regex}), seed)
    assert re.fullmatch(regex, out), out
    choices = ["yes", "no", "maybe not"]
    out = sample(compiler, vocab, StructuredSpec.from_request(guided_choice=choices), seed)
    assert out in choices
    gbnf = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]? [a-z]?'
    out = sample(compiler, vocab, StructuredSpec.from_request(structured_outputs={"grammar": gbnf}), seed)
    assert re.fullmatch(r"(hello|hi) [a-z]{1,3}!", out), out
    lark = 'start: "n=" NUM\nNUM: /[0-9]{1,2}/'
    out = sample(compiler, vocab, StructuredSpec.from_request(guided_grammar=lark), seed)
    assert re.fullmatch(r"n=[0-9]{1,2}", out), out


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_and_named_give_valid_calls(compiler: GrammarCompiler, vocab: Vocab, seed: int) -> None:
    # "now" takes any object as arguments; keep the random walk bounded with "get_weather" alone
    required = tool_choice_spec(TOOLS[:1], "required", vocab.tags_are_tokens)
    calls = parse_tool_calls(sample(compiler, vocab, required, seed)).tool_calls
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    named = tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                             vocab.tags_are_tokens)
    parsed = parse_tool_calls(sample(compiler, vocab, named, seed))
    assert [c.name for c in parsed.tool_calls] == ["get_weather"] and parsed.content is None


def test_tool_call_as_the_tokenizer_encodes_it_is_accepted(compiler: GrammarCompiler, vocab: Vocab) -> None:
    spec = tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "now"}}, vocab.tags_are_tokens)
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    ids = vocab.tok.encode(text).ids
    matcher = compiler.compile(spec).matcher()
    assert all(matcher.accept(t) for t in ids) and matcher.is_terminated(), matcher.error


def test_tool_choice_auto_none_and_errors() -> None:
    assert tool_choice_spec(TOOLS, "auto") is None and tool_choice_spec(TOOLS, "none") is None
    with pytest.raises(ValueError, match="tool_choice"):
        tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ValueError, match="tool_choice"):
        tool_choice_spec([], "required")


def test_compile_cache_hits_on_the_same_schema(compiler: GrammarCompiler) -> None:
    a = StructuredSpec.from_request(structured_outputs={"json": {"type": "object", "properties": {"x": {"type": "integer"}}}})
    b = StructuredSpec.from_request(guided_json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a == b  # the same constraint from another field and spelling
    hits, misses = compiler.stats.hits, compiler.stats.misses
    first = compiler.submit(a)
    assert compiler.submit(b) is first
    assert (compiler.stats.hits - hits, compiler.stats.misses - misses) == (1, 1)
    assert first.result().matcher() is not first.result().matcher()  # each request its own state


def test_rollback_restores_the_mask(compiler: GrammarCompiler, vocab: Vocab) -> None:
    matcher = compiler.compile(StructuredSpec.from_request(guided_regex=r"ab[0-9]+c")).matcher()
    masks = allocate_bitmask(2, vocab.vocab_size)
    ids = vocab.tok.encode("ab1").ids
    assert matcher.accept(ids[0])
    matcher.fill_bitmask(masks[0])
    assert all(matcher.accept(t) for t in ids[1:])
    matcher.rollback(len(ids) - 1)
    matcher.fill_bitmask(masks[1])
    assert torch.equal(masks[0], masks[1])


def test_a_batch_fill_gives_each_rows_own_mask(compiler: GrammarCompiler, vocab: Vocab) -> None:
    import llguidance

    specs = [StructuredSpec.from_request(guided_regex=r"ab[0-9]+c"),
             StructuredSpec.from_request(guided_choice=["xy", "z"]),
             StructuredSpec.from_request(response_format={"type": "json_object"})]
    matchers = [compiler.compile(spec).matcher() for spec in specs]
    assert matchers[0].accept(vocab.tok.encode("a").ids[0])  # rows at different points of their grammars
    one_by_one, batch = allocate_bitmask(4, vocab.vocab_size), allocate_bitmask(4, vocab.vocab_size)
    for row, m in zip((0, 1, 3), matchers):
        m.fill_bitmask(one_by_one[row])
    type(matchers[0]).fill_bitmasks(llguidance.LLExecutor(), list(zip(matchers, (0, 1, 3))), batch)
    assert torch.equal(batch[[0, 1, 3]], one_by_one[[0, 1, 3]])
    assert not torch.equal(batch[0], batch[1]) and (batch[2] == -1).all()  # row 2 had no matcher: untouched


def test_refused_token_leaves_the_matcher_in_error(compiler: GrammarCompiler, vocab: Vocab) -> None:
    matcher = compiler.compile(StructuredSpec.from_request(guided_choice=["yes"])).matcher()
    assert matcher.error is None
    assert not matcher.accept(vocab.tok.encode("n").ids[0])
    assert matcher.error


@pytest.mark.parametrize("fields,name", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | ('}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format and structured_outputs.regex"),
])
def test_invalid_input_names_the_field(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name)):
        StructuredSpec.from_request(**fields)


def test_no_constraint() -> None:
    assert StructuredSpec.from_request() is None
    assert StructuredSpec.from_request(response_format={"type": "text"}, structured_outputs={"json": None}) is None


def test_json_schema_strict_false_is_lenient() -> None:
    schema = {"type": "string", "format": "no-such-format"}
    lenient = StructuredSpec.from_request(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert lenient is not None
    with pytest.raises(ValueError, match="response_format.json_schema.schema"):
        StructuredSpec.from_request(response_format={"type": "json_schema",
                                                      "json_schema": {"schema": schema, "strict": True}})


def test_apply_bitmask_matches_a_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    mask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    for row in range(3):
        for token in range(vocab):
            if not (int(mask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, mask)
    assert torch.equal(logits, expected)
    wide = torch.zeros(1, 100)  # logits wider than the mask: ids past it are disallowed
    apply_bitmask(wide, torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 64:]).all() and (wide[0, :64] == 0).all()


def _slow_builds(monkeypatch, seconds: float) -> list[int]:
    """Makes every token trie build take `seconds` longer; returns the ids of the threads that built."""
    seen: list[int] = []
    real = llguidance.LLTokenizer

    def slow(*args, **kwargs):
        seen.append(threading.get_native_id())
        time.sleep(seconds)  # widens the window in which a caller that did not wait would go on
        return real(*args, **kwargs)

    monkeypatch.setattr(grammar.llguidance, "LLTokenizer", slow)
    return seen


def test_the_token_trie_builds_once_on_a_thread_of_its_own_and_ready_waits_for_it(vocab: Vocab, monkeypatch) -> None:
    """compiler_for starts the build on another thread; ready() returns only once it is built (the
    build holds the interpreter lock, so a child must not report ready before it); compiles reuse it."""
    seen = _slow_builds(monkeypatch, 0.5)
    compiler = ConstrainedRows.compiler_for(Path(vocab.path).parent, vocab.vocab_size, [vocab.eos])
    try:
        rows = ConstrainedRows(compiler, torch.zeros(1, (vocab.vocab_size + 31) // 32, dtype=torch.int32))
        rows.ready()
        assert compiler._tokenizer is not None
        compiler.compile(StructuredSpec.of({"regex": "a+"}))
        assert seen and set(seen) != {threading.get_native_id()} and len(seen) == 1
    finally:
        compiler.close()


def test_a_runtime_is_built_only_once_its_token_trie_is(monkeypatch) -> None:
    """ChipRuntime() (a chip-child's start, before its ready report) returns with the trie built."""
    _slow_builds(monkeypatch, 1.0)
    rt = ChipRuntime(RuntimeConfig(str(ensure_tiny_model()), device="cpu", max_batch_size=2, max_seq_len=64,
                                   page_size=16))
    try:
        assert rt.grammars.compiler is not None and rt.grammars.compiler._tokenizer is not None
    finally:
        rt.close()