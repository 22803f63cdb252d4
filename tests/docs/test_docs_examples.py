"""Every python and bash block in README.md and docs/ either runs here against the built-in models,
or says what it needs (a GPU, an NPU, several nodes, a checkpoint, the network) and is skipped,
visibly, after a syntax check. How blocks are classified: doc_blocks.py and docs/development.md."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from doc_blocks import EXAMPLE_SERVERS, ROOT, Block, all_blocks, at_address, check_syntax

# Grouped by the server they run against (offline blocks first, the servers the example scripts
# reuse last), page order kept within a group, so each documented server starts once.
BLOCKS = sorted(all_blocks(), key=lambda b: (b.server in EXAMPLE_SERVERS.values(), b.server or "", b.path, b.line))
RUN_TIMEOUT_S = 240
EXAMPLE_SCRIPTS = {"examples/offline_chat.py", "examples/openai_stream.py", "examples/tool_calling.py",
                   "examples/structured_outputs.py", "examples/reasoning.py", "examples/local_server.py",
                   "examples/monitoring/prometheus.yml"}


def run_python(block: Block, scratch: Path, url: str | None, monkeypatch) -> None:
    """A Python block in this process, as pytest-examples and mktestdocs run them: a fresh
    namespace, the scratch directory as the working directory, a traceback naming the page."""
    code = at_address(block.code, url) if url else block.code
    monkeypatch.chdir(scratch)

    def too_long(signum, frame):
        raise TimeoutError(f"{block.id} ran over {RUN_TIMEOUT_S}s")

    previous = signal.signal(signal.SIGALRM, too_long)  # a bound on the block, as run_bash's timeout
    signal.alarm(RUN_TIMEOUT_S)
    try:
        exec(compile(code, block.id, "exec"), {"__name__": "__main__"})  # noqa: S102 (the docs' own examples)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_bash(block: Block, scratch: Path, path_env: str, url: str | None) -> None:
    code = at_address(block.code, url) if url else block.code
    env = dict(os.environ, PATH=path_env, PYTHONUNBUFFERED="1")
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=scratch, env=env, capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S)
    assert res.returncode == 0, (f"{block.id} exited {res.returncode}\n--- code\n{block.code}\n--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-5000:]}")


# A block that appears twice (the README repeats the quickstart) runs once.
PASSED: set[tuple[str, str | None]] = set()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, doc_servers, l3worker_on_path, scratch, monkeypatch) -> None:
    problem = check_syntax(block)
    assert problem is None, f"{block.id}: {problem}\n{block.code}"
    if block.kind == "needs":
        pytest.skip(f"{block.id}: {block.reason}")
    if block.kind == "ci":
        return  # .ci/run runs it (test_ci_runs_the_readme_commands checks it is there)
    if block.kind == "snippet":
        missing = [p for p in block.reason.split(", ") if p not in EXAMPLE_SCRIPTS or not (ROOT / p).is_file()]
        assert not missing, f"{block.id}: includes {missing}, which test_examples_scripts.py does not run"
        return
    if block.kind == "serve":
        url = doc_servers.url(block.server)
        assert url.startswith("http://127.0.0.1:")
        return
    url = doc_servers.url(block.server) if block.server and "8000" in block.code else None
    key = (block.code, url)
    if key in PASSED:
        return
    if block.lang == "python":
        run_python(block, scratch, url, monkeypatch)
    else:
        run_bash(block, scratch, l3worker_on_path, url)
    PASSED.add(key)


def test_blocks_are_found_and_most_run() -> None:
    """The collector sees the pages' blocks: a change that hid them all would pass silently."""
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("python") >= 10 and kinds.count("bash") >= 5 and kinds.count("serve") >= 3, kinds
    assert kinds.count("needs") < kinds.count("python") + kinds.count("bash")
    pages = {b.path for b in BLOCKS}
    assert "README.md" in pages and "docs/getting-started/quickstart.md" in pages


def test_ci_runs_the_readme_commands() -> None:
    """.ci/run calls the README's two commands verbatim (and builds the site strictly)."""
    readme = sorted((b for b in BLOCKS if b.path == "README.md"), key=lambda b: b.line)
    first = readme[0]
    assert first.kind == "ci", first
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in first.code.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].endswith("python examples/npu_generate.py") and commands[1].endswith("python -m pytest -q -n 4")
    assert all(c in ci for c in commands)
    assert "mkdocs build --strict" in ci


def test_readme_is_short_and_its_links_resolve() -> None:
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    # the two commands on the first screen
    assert text.index("python examples/npu_generate.py") < 1500 and text.index("python -m pytest -q -n 4") < 1500
    links = re.findall(r"\]\(([^)#]+?\.md)(#[^)]*)?\)", text)
    assert links
    for target, _ in links:
        assert (ROOT / target).is_file(), target
