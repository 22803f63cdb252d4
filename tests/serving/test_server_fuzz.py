"""Hostile HTTP input: every operation of the server's own OpenAPI document fuzzed with schemathesis
(bodies that fit the schema and bodies that do not), bounded in examples and time. No answer is a
5xx, every 4xx carries OpenAI's error body, and the server still serves afterwards."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from l3worker import DistributedWorker
from l3worker.serving.runner import ServerThread

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 30  # per operation and mode: bounded, as each case is a real request to a real engine
OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
              "GET /metrics", "POST /tokenize", "POST /detokenize", "GET /version", "GET /ping", "POST /ping"}
BODILESS = {"POST /ping"}  # nothing for a negative case to break


@pytest.fixture(scope="module")
def server():
    worker = DistributedWorker(None, device="cpu", max_batch_size=4, max_seq_len=64, page_size=16, num_threads=1)
    with ServerThread(worker) as srv:
        yield srv


@pytest.fixture(scope="module")
def operations(server) -> dict:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in ops}


def test_the_schema_describes_every_operation_and_its_body(server) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    ops = {f"{method.upper()} {path}" for path, methods in doc["paths"].items() for method in methods}
    assert ops == OPERATIONS
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "$ref" in body, (path, body)


def check(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert "Traceback" not in response.text


# Positive requests fit the schema; negative ones break it somewhere, so need a body to break.
CASES = [(name, schemathesis.GenerationMode.POSITIVE) for name in sorted(OPERATIONS)] + \
    [(name, schemathesis.GenerationMode.NEGATIVE) for name in sorted(OPERATIONS - BODILESS) if name.startswith("POST")]


@pytest.mark.parametrize(("name", "mode"), CASES, ids=[f"{n}-{m.value}" for n, m in CASES])
def test_fuzzed_requests_get_no_5xx_and_openai_errors(operations, name: str, mode) -> None:

    @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), database=None)
    @given(case=operations[name].as_strategy(mode))
    def fuzz(case) -> None:
        check(case.call(timeout=60))

    fuzz()


def test_still_serving_after_the_fuzzing(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert c.get("/metrics").status_code == 200
