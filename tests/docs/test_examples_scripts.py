"""The example scripts the docs include, run as a user runs them (subprocesses from a scratch
directory), against the built-in tiny model. The tiny model has random weights, so the checks are
on shape: what a grammar guarantees (a JSON-schema reply validates, a forced tool call's arguments
match the tool's parameters), and that every part of a script's output is there."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from doc_blocks import EXAMPLE_SERVERS, ROOT

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300


def run(script: str, *args: str, cwd: Path) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 0, f"{script} exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def module_constant(script: str, name: str):
    """A constant of an example (its schema, its tools), read without importing the script."""
    import ast

    tree = ast.parse((EXAMPLES / script).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


@pytest.fixture
def server_for(doc_servers):
    """The URL of the documented server an example needs (shared with the pages' blocks)."""
    def url(script: str) -> str:
        return doc_servers.url(EXAMPLE_SERVERS[script])
    return url


@pytest.mark.parametrize("script", sorted(EXAMPLE_SERVERS))
def test_scripts_start_the_server_they_are_tested_against(script) -> None:
    flags = tuple(EXAMPLE_SERVERS[script].split()[2:])
    try:
        assert tuple(module_constant(script, "SERVE_FLAGS")) == flags
    except KeyError:
        assert flags == (), script


def test_offline_chat(tmp_path) -> None:
    out = run("offline_chat.py", "--max-tokens", "8", cwd=tmp_path)
    assert out.count("user: ") == 2 and out.count("assistant: ") == 2, out
    m = re.search(r"^assistant: .* \((stop|length), (\d+) prompt tokens from the prefix cache\)$", out, re.M)
    assert m and int(m[2]) > 0, out  # the second turn starts with the first turn's prompt
    assert len(re.findall(r"^batch: '.*' -> ", out, re.M)) == 3, out


def test_openai_stream_starts_its_own_server(tmp_path) -> None:
    out = run("openai_stream.py", cwd=tmp_path)
    assert re.search(r"^chat finish_reason: (stop|length)$", out, re.M), out
    m = re.search(r"^chat usage: prompt_tokens=(\d+) completion_tokens=(\d+)$", out, re.M)
    assert m and int(m[1]) > 0 and 1 <= int(m[2]) <= 32
    assert re.search(r"^completion finish_reason: (stop|length)$", out, re.M), out


def test_tool_calling(server_for, tmp_path) -> None:
    out = run("tool_calling.py", "--base-url", server_for("tool_calling.py"), cwd=tmp_path)
    tools = module_constant("tool_calling.py", "TOOLS")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    sections = re.split(r"^tool_choice (\w+): ", out, flags=re.M)[1:]
    got = dict(zip(sections[::2], sections[1::2]))
    assert set(got) == {"auto", "required", "named"}, out
    for choice in ("required", "named"):
        assert got[choice].startswith("finish_reason=tool_calls"), got[choice]
        calls = re.findall(r"^  call (call_\w{24}) (\w+) (.*)$", got[choice], re.M)
        assert calls, got[choice]
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), params[name])
    assert "answer after the tool result: " in out


def test_structured_outputs(server_for, tmp_path) -> None:
    out = run("structured_outputs.py", "--base-url", server_for("structured_outputs.py"), cwd=tmp_path)
    fields = dict(re.findall(r"^(json_schema|pydantic|regex|choice): (.*)$", out, re.M))
    assert set(fields) == {"json_schema", "pydantic", "regex", "choice"}, out
    jsonschema.validate(json.loads(fields["json_schema"]), module_constant("structured_outputs.py", "SCHEMA"))
    assert fields["pydantic"].startswith("User(name=")
    assert re.fullmatch(module_constant("structured_outputs.py", "REGEX"), fields["regex"]), fields["regex"]
    assert fields["choice"] in module_constant("structured_outputs.py", "CHOICES")


def test_reasoning(server_for, tmp_path) -> None:
    out = run("reasoning.py", "--base-url", server_for("reasoning.py"), cwd=tmp_path)
    assert re.search(r"^enable_thinking=True: finish_reason=(stop|length)$", out, re.M), out
    assert re.search(r"^enable_thinking=False: finish_reason=(stop|length)$", out, re.M), out
    # thinking off: an empty closed think block in the prompt, so no reasoning whatever the model writes
    after_off = out.split("enable_thinking=False:")[1]
    assert after_off.splitlines()[1] == "  reasoning_content: None", after_off
    assert out.count("  reasoning_content: ") == 3 and out.count("  content: ") == 3
    assert "streamed:" in out
