"""vLLM's offline documentation examples (quickstart, offline chat, structured outputs) run against
l3worker with the import changed from vllm to l3worker. The model changes too, as nothing can be
downloaded here: the built-in tiny model (`LLM()`), or for chat the scripted checkpoint, whose
greedy replies are known. Each test then checks what the example relies on."""
from __future__ import annotations

from enum import Enum

import pytest
from pydantic import BaseModel, ConfigDict, Field

from l3worker import LLM, SamplingParams, StructuredOutputsParams
from scripted_model import REPLY_NO_THINK, REPLY_TOOL, TOOLS, write_scripted_model


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:  # the docs: LLM(model="facebook/opt-125m")
        yield llm


def test_quickstart_offline_batched_inference(llm, capsys) -> None:
    # docs/getting_started/quickstart.md, "Offline Batched Inference"
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"Prompt: {p!r}, Generated text: {o.outputs[0].text!r}" for p, o in zip(prompts, outputs)]
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        sample = output.outputs[0]
        assert output.prompt == prompt and output.finished
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert sample.index == 0 and sample.finish_reason in ("stop", "length")
        assert 1 <= len(sample.token_ids) <= 16  # SamplingParams' default max_tokens
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    with LLM(model=str(write_scripted_model(tmp_path_factory.mktemp("scripted")))) as llm:
        yield llm


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    print("-" * 80)


def test_offline_chat(scripted, capsys) -> None:
    # examples/offline_inference/basic/chat.py (the docs' model: meta-llama/Meta-Llama-3-8B-Instruct;
    # temperature 0 here, for the scripted model's known reply)
    llm = scripted
    sampling_params = SamplingParams(temperature=0)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
    print_outputs(outputs)
    # With tools and a batch of conversations, as that example's later calls do.
    conversations = [conversation for _ in range(3)]
    batch = llm.chat(conversations, sampling_params=sampling_params, use_tqdm=True, tools=TOOLS)
    print_outputs(batch)
    # enable_thinking=False reaches the template through chat_template_kwargs.
    quiet = llm.chat(conversation, sampling_params, chat_template_kwargs={"enable_thinking": False})

    rendered = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert outputs[0].prompt == rendered and outputs[0].prompt_token_ids == llm.get_tokenizer().encode(
        rendered, add_special_tokens=False)
    assert outputs[0].outputs[0].text == REPLY_TOOL  # the reply the scripted model writes with thinking on
    assert [o.outputs[0].text for o in batch] == [REPLY_TOOL] * 3
    assert all("<tools>" in o.prompt and "get_weather" in o.prompt for o in batch)
    assert quiet[0].prompt.endswith("<think>\n\n</think>\n\n") and quiet[0].outputs[0].text == REPLY_NO_THINK
    assert all(o.outputs[0].finish_reason == "stop" for o in [*outputs, *batch, *quiet])
    printed = capsys.readouterr().out
    assert printed.count(f"Generated text: {REPLY_TOOL!r}") == 4 and printed.count("-" * 80) == 2


def test_structured_outputs_choice(llm) -> None:
    # docs/features/structured_outputs.md, "Offline Inference"
    structured_outputs_params = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params = SamplingParams(structured_outputs=structured_outputs_params)
    outputs = llm.generate(
        prompts="Classify this sentiment: vLLM is wonderful!",
        sampling_params=sampling_params,
    )
    print(outputs[0].outputs[0].text)

    assert outputs[0].outputs[0].text in ("Positive", "Negative")
    assert outputs[0].outputs[0].finish_reason == "stop"


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    # The docs' fields, with two additions for a random-weight model: a maxLength (it rarely closes a
    # string by itself), and no other properties (vLLM's default grammar backend, xgrammar, allows
    # none that the schema leaves unlisted; llguidance follows JSON Schema and allows them).
    model_config = ConfigDict(extra="forbid")
    brand: str = Field(max_length=8)
    model: str = Field(max_length=8)
    car_type: CarType


def test_structured_outputs_json_schema(llm) -> None:
    # docs/features/structured_outputs.md, "Offline Inference" (max_tokens added: the built-in model
    # writes one character per token)
    json_schema = CarDescription.model_json_schema()
    structured_outputs_params_json = StructuredOutputsParams(json=json_schema)
    sampling_params_json = SamplingParams(structured_outputs=structured_outputs_params_json, max_tokens=100)
    prompt = ("Generate a JSON with the brand, model and car_type of"
              "the most iconic car from the 90's")
    outputs = llm.generate(
        prompts=prompt,
        sampling_params=sampling_params_json,
    )
    print(outputs[0].outputs[0].text)

    assert outputs[0].outputs[0].finish_reason == "stop"
    CarDescription.model_validate_json(outputs[0].outputs[0].text)  # raises unless the schema holds


def test_disable_additional_properties_closes_the_schema(llm) -> None:
    schema = CarDescription.model_json_schema()
    del schema["additionalProperties"]  # as pydantic writes it without extra="forbid"
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True, disable_any_whitespace=True)
    outputs = llm.generate(["A car:", "Another car:"], SamplingParams(structured_outputs=so, max_tokens=100))
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        CarDescription.model_validate_json(output.outputs[0].text)
        text = output.outputs[0].text
        assert text.startswith('{"brand":"') and '","model":"' in text and '","car_type":"' in text  # no blanks
