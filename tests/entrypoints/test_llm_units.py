"""The offline API's parts that need no worker: SamplingParams and StructuredOutputsParams as vLLM
writes them, the engine-argument mapping, generation_config.json defaults, the tokenizer against
transformers', and chat messages as the template receives them."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from chip_child.models.tiny_model import ensure_tiny_model
from l3worker import SamplingParams, StructuredOutputsParams
from l3worker.entrypoints.engine_args import worker_kwargs
from l3worker.entrypoints.generation_config import default_sampling_fields
from l3worker.entrypoints.inputs import template_messages
from l3worker.entrypoints.tokenizer import LLMTokenizer
from l3worker.structured.specs import StructuredSpec
from scripted_model import TOOLS


# -- SamplingParams ---------------------------------------------------------------------------------
def test_sampling_params_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n, p.seed) == (16, 1.0, 1.0, 0, 0.0, 1, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs, p.prompt_logprobs) == \
        ((), (), False, 0, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens and not p.include_stop_str_in_output and p.structured_outputs is None


def test_max_new_tokens_is_an_alias_of_max_tokens() -> None:
    assert SamplingParams(max_new_tokens=5) == SamplingParams(max_tokens=5)
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert dataclasses.replace(SamplingParams(max_new_tokens=5), temperature=0.0).max_tokens == 5
    with pytest.raises(ValueError, match="max_tokens or its alias max_new_tokens"):
        SamplingParams(max_tokens=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"max_tokens must be >= 1"):
        SamplingParams(max_tokens=0).validate(100)
    SamplingParams(max_tokens=None, min_tokens=50).validate(100)  # the limit is the sequence's room, checked later


def test_vllm_spellings_are_read_as_vllm_reads_them() -> None:
    p = SamplingParams(top_k=-1, seed=-1, stop=None, stop_token_ids=None)
    assert (p.top_k, p.seed, p.stop, p.stop_token_ids) == (0, None, (), ())
    assert SamplingParams(stop="x", stop_token_ids=[3, 4]) == SamplingParams(stop=("x",), stop_token_ids=(3, 4))
    with pytest.raises(TypeError):
        SamplingParams(16)  # keywords only: vLLM's positional order is not l3worker's


@pytest.mark.parametrize("name,neutral,other", [
    ("detokenize", True, False), ("logit_bias", None, {5: 1.0}), ("bad_words", [], ["no"]),
    ("allowed_token_ids", None, [1, 2]), ("spaces_between_special_tokens", True, False),
    ("truncate_prompt_tokens", None, 8), ("logits_processors", None, [print]),
])
def test_vllm_fields_without_an_implementation(name: str, neutral, other) -> None:
    assert SamplingParams(**{name: neutral}) == SamplingParams()
    with pytest.raises(ValueError, match=f"{name}=.* is not supported by l3worker"):
        SamplingParams(**{name: other})


def test_structured_outputs_params() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    cases = [
        (StructuredOutputsParams(choice=["x", "y"]), StructuredSpec("choice", '["x","y"]')),
        (StructuredOutputsParams(regex="[0-9]+"), StructuredSpec("regex", "[0-9]+")),
        (StructuredOutputsParams(json=json.dumps(schema)), StructuredSpec.of({"json": schema})),
        (StructuredOutputsParams(json_object=True), StructuredSpec.of({"json_object": True})),
        (StructuredOutputsParams(grammar='root ::= "a" | "b"'), StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ]
    for given, want in cases:
        assert SamplingParams(structured_outputs=given).structured_outputs == want
    closed = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, disable_additional_properties=True))
    value = json.loads(closed.structured_outputs.value)
    assert value["additionalProperties"] is False and value["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in value["properties"]  # a property name, not a schema keyword
    compact = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert json.loads(compact.structured_outputs.value)["x-guidance"]["item_separator"] == ","


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "exactly one of json, regex, choice, grammar, json_object, got none"),
    (dict(json={}, regex="a"), "got json, regex"),
    (dict(structural_tag="{}"), "structural_tag is not supported"),
    (dict(regex="a", whitespace_pattern=" "), "whitespace_pattern is not supported"),
])
def test_structured_outputs_params_refusals(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_bad_constraint_is_refused_when_the_params_are_made() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs.choice must be a non-empty list"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=[]))
    with pytest.raises(ValueError, match=r"structured_outputs.regex"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))


# -- engine arguments -------------------------------------------------------------------------------
def test_vllm_engine_arguments_map_to_the_worker() -> None:
    got = worker_kwargs(dict(max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.5, enforce_eager=True,
                             dtype=torch.bfloat16, block_size=16, num_gpu_blocks_override=40, tensor_parallel_size=1,
                             quantization=None, swap_space=4, trust_remote_code=True, device="cpu"))
    assert got == dict(max_batch_size=8, max_seq_len=512, gpu_memory_utilization=0.5, decode_graphs=False,
                       dtype="bfloat16", page_size=16, num_pages=40, tensor_parallel_size=1, device="cpu")
    assert worker_kwargs(dict(dtype="float", enforce_eager=False)) == dict(dtype="float32", decode_graphs=None)
    assert worker_kwargs(dict(kv_cache_memory_bytes=1 << 30)) == dict(kv_cache_memory_bytes=1 << 30)


# -- sampling defaults --------------------------------------------------------------------------------
def test_generation_config_fields(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_k": 20, "max_new_tokens": 64, "min_p": None, "do_sample": True, "eos_token_id": 2}))
    assert default_sampling_fields(tmp_path) == dict(temperature=0.7, top_k=20, max_tokens=64)
    assert default_sampling_fields(tmp_path, "vllm") == {}
    assert default_sampling_fields(tmp_path / "nothing-here") == {}  # a checkpoint may have none
    assert default_sampling_fields(tmp_path, "vllm", {"top_p": 0.5}) == dict(top_p=0.5)
    assert default_sampling_fields(tmp_path / "x", str(tmp_path), {"temperature": 0.1}) == \
        dict(temperature=0.1, top_k=20, max_tokens=64)
    with pytest.raises(ValueError, match="generation_config="):
        default_sampling_fields(tmp_path, str(tmp_path / "missing"))


# -- tokenizer -------------------------------------------------------------------------------------------
def test_tokenizer_behaves_as_transformers() -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    model = ensure_tiny_model()
    hf = AutoTokenizer.from_pretrained(model)
    tok = LLMTokenizer(Tokenizer.from_file(str(model / "tokenizer.json")), model)
    text = "Hello, wörld <|im_end|>"
    assert tok.encode(text) == hf.encode(text) and tok.encode(text, add_special_tokens=False) == \
        hf.encode(text, add_special_tokens=False)
    ids = hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids) and tok.decode(ids, skip_special_tokens=True) == \
        hf.decode(ids, skip_special_tokens=True)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == \
        (hf.eos_token, hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
    assert (len(tok), tok.vocab_size, tok.convert_ids_to_tokens(ids)) == (len(hf), hf.vocab_size,
                                                                         hf.convert_ids_to_tokens(ids))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    for kwargs in (dict(add_generation_prompt=True), dict(add_generation_prompt=True, tools=TOOLS),
                   dict(add_generation_prompt=True, enable_thinking=False),
                   dict(add_generation_prompt=False, continue_final_message=True)):
        want = hf.apply_chat_template(conv, tokenize=False, **kwargs)
        assert tok.apply_chat_template(conv, tokenize=False, **kwargs) == want
        assert tok.apply_chat_template(conv, **kwargs) == hf.encode(want, add_special_tokens=False)
    assert tok.apply_chat_template([conv, conv[:1]], tokenize=False) == \
        [hf.apply_chat_template(c, tokenize=False) for c in (conv, conv[:1])]
    assert tok.chat_template == hf.chat_template


def test_chat_messages_as_the_template_receives_them() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]}]
    got = template_messages(conv, "string", -1)
    assert got[0]["content"] == "a\nb" and got[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, untouched
    assert template_messages([{"role": "user", "content": "a"}], "openai", -1)[0]["content"] == \
        [{"type": "text", "text": "a"}]
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a 'role'"):
        template_messages([{"role": "user", "content": "a"}, {"content": "b"}], "string", -1)


def test_vllms_module_paths_hold_the_same_types() -> None:
    import l3worker
    from l3worker.inputs import TextPrompt, TokensPrompt
    from l3worker.sampling_params import SamplingParams, StructuredOutputsParams

    assert (SamplingParams, StructuredOutputsParams, TextPrompt, TokensPrompt) == \
        (l3worker.SamplingParams, l3worker.StructuredOutputsParams, l3worker.TextPrompt, l3worker.TokensPrompt)
