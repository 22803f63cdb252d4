#!/usr/bin/env python
"""Where the serving process's CPU goes per output token: `l3worker serve` with thread-CPU counters
around the step loop's and the HTTP path's functions (inclusive times: a caller's count holds its
callees'). A sampling profiler counts a thread that waits for a core as busy; on a machine whose
cores the child's threads fill, that is most of what it would show.

    python scripts/serve_cpu_profile.py /path/to/model --inline-engine ...   # any serve arguments
    kill -USR1 <pid>   # zero the counters (after a warm-up request); it says so on stderr
    ...drive load with any client...
    kill -USR2 <pid>   # write the table to stderr (then stop the server as usual)

With --inline-engine every function below runs in this process; by default the engine's run in
the engine-core process, and this one counts the API server's alone.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import signal
import sys
import time

COUNTED = {  # module: (class or None for module functions, function names)
    "l3worker.engine.step_loop": ("Engine", ["step", "_send", "_complete", "step_ready"]),
    "l3worker.engine.scheduler": ("Scheduler", ["next_command", "on_tokens"]),
    "l3worker.engine.outputs": ("OutputProcessor", ["process", "report"]),
    "l3worker.worker.child_process": ("ChildProcess", ["send"]),
    "l3worker.serving.inline_engine": ("InlineEngine", ["_on_step_done", "_dispatch"]),
    "l3worker.serving.core_client": ("CoreClient", ["_on_outputs"]),
    "l3worker.serving.openai.endpoint": ("Generation", ["events", "chunk"]),
    "uvicorn.protocols.http.httptools_impl": ("RequestResponseCycle", ["send"]),
}
totals: dict[str, list[int]] = {}  # name: [thread CPU ns, calls]


def _count(name: str, ns: int) -> None:
    entry = totals.setdefault(name, [0, 0])
    entry[0] += ns
    entry[1] += 1


def _wrapped(name: str, fn):
    if inspect.iscoroutinefunction(fn):  # counted while it runs and while it awaits: only for
        @functools.wraps(fn)              # coroutines that seldom suspend (a socket write)
        async def timed_async(*args, **kwargs):
            t0 = time.thread_time_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                _count(name, time.thread_time_ns() - t0)
        return timed_async

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _count(name, time.thread_time_ns() - t0)
    return timed


def install() -> None:
    for module_name, (owner_name, names) in COUNTED.items():
        owner = getattr(importlib.import_module(module_name), owner_name)
        for name in names:
            setattr(owner, name, _wrapped(f"{owner_name}.{name}", getattr(owner, name)))


def main() -> int:
    install()
    start = [time.process_time()]

    def reset(*_) -> None:
        totals.clear()
        start[0] = time.process_time()
        print("serve_cpu_profile: counters zeroed", file=sys.stderr, flush=True)

    def report(*_) -> None:
        tokens = totals.get("Generation.events", [0, 0])[1] or 1
        lines = [f"process CPU {time.process_time() - start[0]:.3f} s; per call and per streamed chunk "
                 f"({tokens} chunks; one a token at stream_interval 1):"]
        for name, (ns, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:34s} {ns / 1e9:8.3f} s {calls:8d} calls {ns / calls / 1e3:8.1f} us/call "
                         f"{ns / tokens / 1e3:8.1f} us/chunk")
        print("\n".join(lines), file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, reset)
    signal.signal(signal.SIGUSR2, report)
    from l3worker.serving.cli import main as serve
    return serve(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
