"""What the client examples share: their command line, and a `l3worker serve` of the built-in
model on a free loopback port for the length of a run, when no --base-url is given."""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Iterator

READY = re.compile(r"^l3worker serve: ready at (\S+) serving (\S+) ")


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000 (default: start "
                   "`l3worker serve` with the built-in tiny model for this run)")
    p.add_argument("--model", help="the model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default="none", help="the server's API key, if it wants one")
    return p


@contextlib.contextmanager
def server_for(args: argparse.Namespace, *serve_flags: str) -> Iterator[tuple[str, str]]:
    """(base URL, model name): --base-url's server, or `l3worker serve SERVE_FLAGS` started for the run."""
    if args.base_url:
        yield args.base_url.rstrip("/"), args.model or first_model(args.base_url, args.api_key)
        return
    with local_server(*serve_flags) as (url, name):
        yield url, args.model or name


def first_model(base_url: str, api_key: str) -> str:
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


@contextlib.contextmanager
def local_server(*serve_flags: str, timeout_s: float = 300.0) -> Iterator[tuple[str, str]]:
    """`l3worker serve SERVE_FLAGS --port 0` as a child process: yields (URL, model name) once it
    prints its ready line; stops it with SIGTERM (as Ctrl-C would) on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "l3worker", "serve", *serve_flags, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    errors: collections.deque[str] = collections.deque(maxlen=40)  # its log, shown if it fails to start

    def pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    threading.Thread(target=pump, args=(proc.stdout, lines.put), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stderr, errors.append), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"l3worker serve was not ready within {timeout_s:.0f}s") from None
            if line is None:
                log = "\n".join(e for e in errors if e)
                raise RuntimeError(f"l3worker serve exited with status {proc.wait()}:\n{log}")
            if m := READY.match(line):
                break
        yield m[1], m[2]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
