"""What the server tests share: a server on a free loopback port, `l3worker serve` as a subprocess,
and SSE parsing of raw bytes."""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

from node_helpers import private_tmpdir

SSE_DONE = b"data: [DONE]\n\n"
ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^l3worker serve: ready at (http://127\.0\.0\.1:\d+) serving (\S+) ")


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


def stream_into(url: str, body: dict, raw: list[bytes], started: threading.Event) -> threading.Thread:
    """A thread streaming POST /v1/completions into `raw`; `started` is set at the first bytes (and
    at the end, so a waiter never outlives a stream that failed at once)."""
    def read() -> None:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for chunk in r.iter_raw():
                raw.append(chunk)
                started.set()
        started.set()

    t = threading.Thread(target=read)
    t.start()
    return t


def concurrent_greedy_texts(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion (ignoring EOS) over POST /v1/completions, all in flight at once."""
    got: dict[int, str] = {}

    def one(k: int) -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"connection": "close"}) as c:
            body = {"prompt": prompts[k], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            got[k] = c.post("/v1/completions", json=body).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [got.get(k) for k in range(len(prompts))]


def offline_greedy_texts(prompts: list[list[int]], max_tokens: int, **worker) -> list[str]:
    """The same from an offline DistributedWorker of the built-in model (`worker`: its arguments)."""
    from l3worker import DistributedWorker, SamplingParams

    with DistributedWorker(None, **worker) as ref:
        return [ref.generate(p, SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))[0].text for p in prompts]


def assert_engines_give_offline_greedy(url: str, engines: int, max_tokens: int = 12, **worker) -> None:
    """Data parallel: six prompts at once over HTTP give offline generate()'s greedy text (a
    DistributedWorker of the built-in model with `worker` arguments), every engine served some, one
    scrape shows each under its `engine` label, and /health is 200."""
    prompts = [[5 + k, 80, 17, 200 + k, 3, 3, 9] for k in range(6)]
    assert concurrent_greedy_texts(url, prompts, max_tokens) == offline_greedy_texts(prompts, max_tokens, **worker)
    with httpx.Client(base_url=url, timeout=60) as http:
        per_engine = [metric(http, "l3worker:generation_tokens_total", f'engine="{e}"') for e in range(engines)]
        assert all(n > 0 for n in per_engine) and sum(per_engine) == max_tokens * len(prompts), per_engine
        assert http.get("/health").status_code == 200


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """A sample from GET /metrics, e.g. metric(c, "l3worker:num_requests_running"): the sum over
    the samples named so whose labels include `labels` (e.g. 'finished_reason="length"'), so over
    every engine unless `labels` names one ('engine="1"')."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = dict(re.findall(r'([\w:]+)="([^"]*)"', labels))
    found = [s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
             if s.name == name and wanted.items() <= s.labels.items()]
    if not found:
        raise AssertionError(f"{name}{{{labels}}} not in /metrics")
    return sum(found)


def sigterm_mid_stream(served: "Served", client: httpx.Client, body: dict) -> list[dict | str]:
    """Streams POST /v1/completions `body` from `served`, sends it SIGTERM at the first bytes, checks
    that it exits 0, and returns the stream's events (sse_events: it must end with [DONE])."""
    raw: list[bytes] = []
    first = threading.Event()

    def read() -> None:
        with client.stream("POST", "/v1/completions", json=body) as r:
            for chunk in r.iter_raw():
                raw.append(chunk)
                first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, served.stderr[-20:]
    reader.join(30)
    return sse_events(b"".join(raw))


def leave_mid_stream(client: httpx.Client, path: str, body: dict) -> None:
    """Opens a streaming request, reads its first event, and goes (the connection closes)."""
    with client.stream("POST", path, json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Polls; a bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.02)


def started_processes(pid: int, module: str) -> list:
    """The processes under `pid` running `python -m <module>` (chip_child, l3worker.serving.engine_core,
    l3worker.serving.api_server), oldest first."""
    import psutil

    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "-m" in cmdline and cmdline[cmdline.index("-m") + 1] == module:
            found.append(proc)
    return sorted(found, key=lambda p: p.create_time())


class Served:
    """A `l3worker serve` subprocess with a private TMPDIR; its stdout lines go to a queue. The
    TMPDIR is short (under /tmp, not the test's own directory, whose path grows with pytest-xdist):
    socket paths under it fit a Unix socket address, so the server's socket dirs land there, where
    tests check them."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None):
        """`command`: what runs `serve` with the arguments that follow (default: `python -m l3worker serve`)."""
        self.tmpdir = private_tmpdir("served-")
        # A step-core claim of its own (l3worker.worker.cpu_placement.claim_core): a worker that
        # this test process keeps alive must not hold the server's core.
        env = dict(os.environ, TMPDIR=str(self.tmpdir), PYTHONPATH=str(ROOT),
                   L3WORKER_CORE_CLAIMS=f"l3worker-{self.tmpdir.name}", **(env or {}))
        command = command or [sys.executable, "-m", "l3worker", "serve"]
        self.proc = subprocess.Popen([*command, "--port", "0", *args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    def ready(self, timeout_s: float = 120.0) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no ready line; stderr: {self.stderr[-20:]}") from None
            if m := READY.match(line):
                return m

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def assert_step_core_kept(line: str, servers: list[psutil.Process], child: psutil.Process) -> None:
    """On a machine of 2 cores or more, a server whose chip-child runs every_core: the ready line
    names the step thread's core, the child's step (main) thread runs there alone, and every thread
    of the serving processes runs on the other cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    assert f"(the step thread alone on core {cores[0]})" in line
    assert os.sched_getaffinity(child.pid) == {cores[0]}
    for proc in servers:
        threads = proc.threads()
        assert threads and all(os.sched_getaffinity(t.id) == set(cores[1:]) for t in threads), proc.cmdline()
