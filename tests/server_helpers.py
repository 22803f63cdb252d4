"""What the server tests share: a server on a free loopback port, and SSE parsing of raw bytes."""
from __future__ import annotations

import json
import time
from typing import Callable

import httpx

SSE_DONE = b"data: [DONE]\n\n"


def sse_events(raw: bytes) -> list[dict | str]:
    """Every event of a stream, checking OpenAI's framing byte for byte: `data: <json>\\n\\n` each,
    the last `data: [DONE]\\n\\n`. Returns the JSON objects, then the string "[DONE]"."""
    assert raw.endswith(SSE_DONE), raw[-200:]
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    events: list[dict | str] = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame[:200]
        body = frame[len(b"data: "):]
        events.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    assert events.count("[DONE]") == 1
    return events


def stream_raw(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with client.stream("POST", path, json=body) as r:
        return r, r.read()


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """A sample from GET /metrics, e.g. metric(c, "l3worker:num_requests_running")."""
    text = client.get("/metrics").text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{key} not in /metrics")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Polls; a bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.02)
