"""The documentation's code blocks: found in README.md and docs/**/*.md, classified, checked and run
(tests/docs/test_docs_examples.py). A block is a fenced block whose language is python or bash;
how each kind is treated is described in docs/development.md ("Runnable examples"):

- needs:   its title starts with "Needs" (```bash title="Needs an NVIDIA GPU"```): not run; checked
           (python compiles, bash parses, its `l3worker` commands parse), skipped with the title.
- ci:      a bash block whose commands all appear verbatim in .ci/run: CI runs it; checked there.
- snippet: `--8<-- "examples/x.py"`: an example script, run by test_examples_scripts.py.
- serve:   a bash block that is one `l3worker serve` command: the server is started (on a free
           port) and the blocks after it on the page run against it.
- python, bash: run.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CI_SCRIPT = ROOT / ".ci" / "run"
LANGS = {"python": "python", "py": "python", "python3": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
TITLE = re.compile(r'title="([^"]*)"')
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"$')
DEFAULT_ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
# The server each client example needs: the docs' own commands for the same flags, so the pages'
# blocks and the scripts share servers (test_examples_scripts.py checks the scripts' flags agree).
EXAMPLE_SERVERS = {
    "openai_stream.py": "l3worker serve",
    "structured_outputs.py": "l3worker serve",
    "tool_calling.py": "l3worker serve --enable-auto-tool-choice --tool-call-parser hermes",
    "reasoning.py": "l3worker serve --reasoning-parser qwen3",
}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "(", ")"}


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    lang: str  # python | bash
    title: str | None
    code: str
    kind: str = ""
    reason: str = ""
    server: str | None = None  # the `l3worker serve` command this block runs against, if any

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    """README.md, then every page under docs/ (the hooks' folder is code, not pages)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *pages]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced python/bash block of a Markdown file, indented ones (in admonitions, tabs) too."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        lang = info.split()[0].lower() if info else ""
        if lang in LANGS:
            title = TITLE.search(info)
            blocks.append(Block(str(path.relative_to(ROOT)), i + 1, LANGS[lang], title[1] if title else None,
                                "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def logical_lines(code: str) -> list[str]:
    """A shell block's commands: continuations joined, comments and blank lines left out."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def classify(blocks: list[Block], ci_text: str) -> list[Block]:
    """Sets each block's kind, reason and server, in page order."""
    server = None
    for b in blocks:
        commands = logical_lines(b.code) if b.lang == "bash" else []
        lines = [line.strip() for line in b.code.splitlines() if line.strip()]
        if b.title and b.title.lower().startswith("needs"):
            b.kind, b.reason = "needs", b.title
        elif lines and all(SNIPPET.match(line) for line in lines):
            b.kind, b.reason = "snippet", ", ".join(SNIPPET.match(line)[1] for line in lines)
        elif commands and all(c in ci_text for c in commands):
            b.kind, b.reason = "ci", "run by .ci/run"
        elif len(commands) == 1 and commands[0].startswith("l3worker serve") and not set(
                shlex.split(commands[0])) & SHELL_OPERATORS:
            b.kind = "serve"
            server = b.server = commands[0]
        else:
            b.kind, b.server = b.lang, server
    return blocks


def all_blocks() -> list[Block]:
    ci_text = CI_SCRIPT.read_text(encoding="utf-8")
    return [b for path in doc_files() for b in classify(fenced_blocks(path), ci_text)]


def l3worker_commands(code: str) -> list[list[str]]:
    """The argument lists of every `l3worker ...` command in a shell block that names no shell
    variable (those are filled in at run time), for parsing with the real command line."""
    found = []
    for line in logical_lines(code):
        if "$" in line or not re.search(r"(^|[;&|(]\s*)l3worker\s", line):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens, segment = list(lexer), []
        except ValueError:  # a quoted string that spans lines: not a command line of its own
            continue
        for token in tokens + [";"]:
            if token in SHELL_OPERATORS or set(token) <= set(";&|<>()"):
                if segment and segment[0] == "l3worker":
                    found.append(segment[1:])
                segment = []
            else:
                segment.append(token)
    return found


def parse_l3worker(argv: list[str]) -> str | None:
    """None when `l3worker ARGV` parses (and passes the checks made before anything loads), else
    the parser's message."""
    import contextlib
    import io

    from l3worker.serving import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if argv and argv[0] == "serve" and hasattr(cli, "parse_serve_args"):
                cli.parse_serve_args(argv)
            else:
                args = cli.build_parser().parse_args(argv)
                if args.command == "bench":
                    from l3worker.bench import checks

                    (checks.check_serve if args.bench_command == "serve" else checks.check_offline)(args)
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()}"
    except ValueError as exc:
        return str(exc)
    return None


def check_syntax(block: Block) -> str | None:
    """None when the block is well formed: Python compiles, bash parses, its l3worker commands parse."""
    if block.lang == "python":
        try:
            compile(block.code, block.id, "exec")
        except SyntaxError as exc:
            return f"SyntaxError: {exc}"
        return None
    res = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return f"bash -n: {res.stderr.strip()}"
    for argv in l3worker_commands(block.code):
        if (problem := parse_l3worker(argv)) is not None:
            return f"`l3worker {' '.join(argv)}`: {problem}"
    return None


def serve_argv(command: str) -> list[str]:
    """`l3worker serve ...` as written, less `--port N` (the test picks a free port)."""
    args = shlex.split(command)[2:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return out


def at_address(code: str, url: str) -> str:
    """The block with the default address (127.0.0.1:8000) replaced by the test server's."""
    hostport = url.split("://", 1)[1]
    for address in DEFAULT_ADDRESSES:
        code = code.replace(address, hostport)
    return code
