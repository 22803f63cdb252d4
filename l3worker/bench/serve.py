"""The serving benchmark's client: streaming /v1/completions or /v1/chat/completions requests over
httpx, arriving as a Poisson process (gamma with --burstiness) at --request-rate, at most
--max-concurrency in flight, each timed from the client's side."""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from l3worker.bench.datasets import SampleRequest
from l3worker.bench.metrics import RequestResult

BACKENDS = ("openai", "vllm", "openai-chat")  # vllm: the completions API with vLLM's extra fields


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    backend: str = "openai"
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, ...: only the ones given
    seed: int = 0
    disable_tqdm: bool = False

    @property
    def chat(self) -> bool:
        return self.backend == "openai-chat"

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def default_api_key() -> str | None:
    """OPENAI_API_KEY as vLLM's client reads it, else the key `l3worker serve` reads."""
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("L3WORKER_API_KEY")


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model of GET /v1/models: the default --model, as in vLLM."""
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key), timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which each request is sent: gamma gaps (exponential at
    burstiness 1), rescaled so the last lands at n / rate as vLLM does; all at 0 for an inf rate."""
    if rate == math.inf:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    at = np.cumsum(gaps)
    return at * ((n / rate) / at[-1])


def request_body(cfg: LoadConfig, sample: SampleRequest) -> dict:
    body: dict = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True}, **cfg.sampling}
    if cfg.chat:
        body |= {"messages": [{"role": "user", "content": sample.prompt}],
                 "max_completion_tokens": sample.expected_output_len}
    else:
        body |= {"prompt": sample.prompt, "max_tokens": sample.expected_output_len}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def request_one(client: httpx.AsyncClient, cfg: LoadConfig, sample: SampleRequest) -> RequestResult:
    """One streamed request; a failure is recorded in the result, never raised."""
    res = RequestResult(prompt_len=sample.prompt_len)
    res.start_time = t0 = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + cfg.endpoint, json=request_body(cfg, sample),
                                 headers=cfg.headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                # Only the rare chunks are parsed: the client often shares the machine with the server.
                if data.startswith('{"error"'):
                    res.error = str(json.loads(data)["error"])
                    return res
                if '"choices":[{' in data and not (cfg.chat and '"role":"assistant"' in data):
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                if '"usage":{' in data:
                    res.output_tokens = json.loads(data)["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.success = True
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(cfg: LoadConfig, samples: list[SampleRequest]) -> tuple[list[RequestResult], float]:
    """A short test request first (it surfaces a wrong model or endpoint before the run), then
    every sample on the arrival schedule; returns the results in sample order and the duration."""
    from tqdm import tqdm

    concurrency = cfg.max_concurrency or len(samples)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    offsets = arrival_offsets(len(samples), cfg.request_rate, cfg.burstiness, np.random.default_rng(cfg.seed))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        first = samples[0]
        test = await request_one(client, cfg, SampleRequest(first.prompt[:8], min(8, first.prompt_len), 4))
        if not test.success:
            raise RuntimeError(f"the initial test request failed: {test.error}")
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(samples), disable=cfg.disable_tqdm)

        async def limited(sample: SampleRequest) -> RequestResult:
            async with gate:
                res = await request_one(client, cfg, sample)
            bar.update(1)
            return res

        tasks = []
        t0 = time.perf_counter()
        for sample, at in zip(samples, offsets):
            if (wait := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.ensure_future(limited(sample)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(results), duration
