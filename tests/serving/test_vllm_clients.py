"""vLLM's own client code against `l3worker serve MODEL_PATH`, changed only in the base URL: the
OpenAI-client examples of vLLM's documentation (quickstart and examples/online_serving), and the
request sequence `vllm bench serve --model MODEL_PATH` sends (GET /v1/models, the local tokenizer
of the model's root, POST /tokenize and /detokenize to align prompts, GET /metrics, the initial test
request, then streamed completions with ignore_eos and include_usage), every request succeeding."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import uuid

import httpx
import pytest
from openai import OpenAI

from chip_child.models.tiny_model import ensure_tiny_model
from server_helpers import Served

NUM_PROMPTS = 12
INPUT_LEN, OUTPUT_LEN = 24, 8


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_tiny_model())  # a checkpoint directory, named by its path as a vLLM user would


@pytest.fixture(scope="module")
def base_url(model_path):
    """`l3worker serve MODEL_PATH` (as `vllm serve MODEL_PATH`), small enough for a test machine."""
    s = Served(model_path, "--max-model-len", "512", "--block-size", "16",
               "--max-num-seqs", "4", "--disable-log-stats")
    try:
        url, name = s.ready().groups()
        assert name == model_path
        yield url
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(base_url) -> OpenAI:
    # vLLM's examples: openai_api_key = "EMPTY"; openai_api_base = "http://localhost:8000/v1"
    return OpenAI(api_key="EMPTY", base_url=base_url + "/v1", max_retries=0, timeout=120)


# -- docs.vllm.ai quickstart, "OpenAI-Compatible Server" ----------------------------------------------
def test_quickstart_completions(client, model_path) -> None:
    completion = client.completions.create(model=model_path, prompt="San Francisco is a")
    assert completion.model == model_path and completion.object == "text_completion"
    assert isinstance(completion.choices[0].text, str) and completion.usage.completion_tokens >= 1


def test_quickstart_chat_completions(client, model_path) -> None:
    chat_response = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Tell me a joke."}],
        max_tokens=16,  # the tiny model never says EOS; the example's default runs to --max-model-len
    )
    message = chat_response.choices[0].message
    assert chat_response.model == model_path and message.role == "assistant" and isinstance(message.content, str)


# -- examples/online_serving/openai_completion_client.py and openai_chat_completion_client.py -----------
@pytest.mark.parametrize("stream", [False, True])
def test_example_completion_client(client, stream) -> None:
    models = client.models.list()
    model = models.data[0].id
    completion = client.completions.create(model=model, prompt="A robot may not injure a human being", echo=False,
                                           n=2, stream=stream, logprobs=3, max_tokens=8)
    if stream:
        chunks = list(completion)
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                 for i in (0, 1)}
        finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].finish_reason}
        # vLLM's default temperature 1.0 samples: a choice may draw EOS at once (no text, "stop")
        assert set(finishes) == {0, 1} and set(finishes.values()) <= {"length", "stop"}
        assert all(texts[i] for i, reason in finishes.items() if reason == "length")
    else:
        assert [c.index for c in completion.choices] == [0, 1]
        # the top 3 and the sampled token (as vLLM, which adds it when it is not among them), keyed by text:
        # tokens spelled alike (partial UTF-8) share an entry
        assert all(1 <= len(top) <= 4 for c in completion.choices for top in c.logprobs.top_logprobs)
        # vLLM's default temperature 1.0 samples: a choice may draw EOS before its 8 tokens
        assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in completion.choices)
        assert all((c.finish_reason == "length" and len(c.logprobs.tokens) == 8)
                   or (c.finish_reason == "stop" and len(c.logprobs.tokens) <= 8) for c in completion.choices)
        assert sum(len(c.logprobs.tokens) for c in completion.choices) == completion.usage.completion_tokens


def test_example_chat_completion_client(client) -> None:
    models = client.models.list()
    model = models.data[0].id
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"},
                {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
                {"role": "user", "content": "Where was it played?"}]
    chat_completion = client.chat.completions.create(messages=messages, model=model, max_tokens=16)
    assert chat_completion.choices[0].message.role == "assistant"
    # the streaming form of the same example
    stream = client.chat.completions.create(messages=messages, model=model, max_tokens=16, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert isinstance(text, str)


def test_docs_extra_body_structured_outputs(client, model_path) -> None:
    # docs: "Extra parameters" / structured outputs, guided by choice
    completion = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert completion.choices[0].message.content in ("positive", "negative")


# -- `vllm bench serve --model MODEL_PATH` ---------------------------------------------------------------
def _sse_messages(raw: str) -> list[str]:
    """vllm.benchmarks.lib.endpoint_request_func.StreamedResponseHandler's split."""
    return [m.strip() for m in raw.split("\n\n") if m.strip()]


async def _bench_request(http: httpx.AsyncClient, payload: dict, request_id: str | None) -> dict:
    """async_request_openai_completions' request and its reading of the stream."""
    headers = {"x-request-id": request_id} if request_id else {}
    out = {"success": False, "text": "", "chunks": 0, "output_tokens": None}
    async with http.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
        if r.status_code != 200:
            out["error"] = f"{r.status_code} {await r.aread()!r}"
            return out
        raw = (await r.aread()).decode()
    for message in _sse_messages(raw):
        if message.startswith(":"):
            continue
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if choices := data.get("choices"):
            out["chunks"] += 1
            out["text"] += choices[0].get("text") or ""
        elif usage := data.get("usage"):
            out["output_tokens"] = usage.get("completion_tokens")
    out["success"] = out["chunks"] > 0
    return out


def test_vllm_bench_serve_request_sequence_all_succeed(base_url, model_path) -> None:
    from transformers import AutoTokenizer

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
            # get_first_model_from_server: the id to send and the root to load the tokenizer from
            card = (await http.get("/v1/models")).json()["data"][0]
            model_id, root = card["id"], card["root"]
            assert (model_id, root) == (model_path, model_path)
            tokenizer = AutoTokenizer.from_pretrained(root)
            # the random dataset: random token ids decoded into text, their length by the local tokenizer
            rng = random.Random(0)
            prompts = []
            for _ in range(NUM_PROMPTS):
                text = tokenizer.decode([rng.randrange(33, 127) for _ in range(INPUT_LEN)])
                prompts.append((text, len(tokenizer.encode(text, add_special_tokens=False))))
            # _align_prompts_to_server_tokenizer: the server's count must agree with the local one
            tok = await http.post("/tokenize", json={"model": model_id, "prompt": prompts[0][0],
                                                     "add_special_tokens": False})
            assert tok.status_code == 200 and tok.json()["count"] == prompts[0][1]
            detok = await http.post("/detokenize", json={"model": model_id, "tokens": tok.json()["tokens"][:10]})
            assert detok.status_code == 200 and isinstance(detok.json()["prompt"], str)
            assert (await http.get("/metrics")).status_code == 200  # fetch_spec_decode_metrics, before

            def payload(prompt: str) -> dict:
                return {"model": model_id, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": OUTPUT_LEN,
                        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                        "ignore_eos": True}

            first = await _bench_request(http, payload(prompts[0][0]), None)  # "initial single prompt test run"
            assert first["success"], first
            prefix = f"bench-{uuid.uuid4().hex[:8]}-"
            outputs = await asyncio.gather(*[_bench_request(http, payload(p), f"{prefix}{i}")
                                             for i, (p, _) in enumerate(prompts)])
            assert (await http.get("/metrics")).status_code == 200  # and after
            return outputs

    outputs = asyncio.run(run())
    failed = [o for o in outputs if not o["success"]]
    assert not failed, failed
    assert [o["output_tokens"] for o in outputs] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos: every token


def test_a_request_priority_without_the_priority_policy_is_vllms_400(client, model_path) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="scheduling_policy='priority'"):
        client.completions.create(model=model_path, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
