"""The generated reference pages (docs/hooks/references.py) against the code they are generated from,
without building the site: every flag of every `l3worker` command, every metric, every public
dataclass field; no secret from the builder's environment; and the names the hand-written pages
use (metrics, flags, SamplingParams fields, DistributedWorker arguments) still exist."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import re

import pytest

from doc_blocks import DOCS, ROOT, doc_files


@pytest.fixture(scope="module")
def refs():
    spec = importlib.util.spec_from_file_location("docs_references_hook", DOCS / "hooks" / "references.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(refs) -> dict[str, str]:
    return refs.generated_pages()


def nav_pages() -> set[str]:
    return set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))


def test_generated_pages_are_in_the_navigation(pages) -> None:
    assert set(pages) <= nav_pages()
    assert {"reference/cli-serve.md", "reference/cli-bench.md", "reference/metrics.md"} <= set(pages)


def test_every_flag_of_every_command_is_documented(refs, pages) -> None:
    leaves = refs.leaf_commands()
    assert {"serve", "bench serve", "bench throughput", "bench latency"} <= {name for name, _ in leaves}
    for name, parser in leaves:
        page = pages[f"reference/cli-{name.split()[0]}.md"]
        assert f"## `l3worker {name}`" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = refs._invocation(parser, action)
            assert f"| `{shown}` |" in page, (name, shown)


def test_groups_follow_the_parser(refs, pages) -> None:
    serve = dict(refs.leaf_commands())["serve"]
    page = pages["reference/cli-serve.md"]
    for group in serve._action_groups:
        if [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]:
            title = group.title or "options"
            assert f"### {title[0].upper()}{title[1:]} (`serve`)" in page


def test_no_api_key_from_the_environment_reaches_the_pages(refs, monkeypatch) -> None:
    monkeypatch.setenv("L3WORKER_API_KEY", "leaked-secret-1")
    monkeypatch.setenv("OPENAI_API_KEY", "leaked-secret-2")
    text = "\n".join(refs.generated_pages().values())
    assert "leaked-secret" not in text


def test_every_metric_is_listed_with_its_labels(refs, pages) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client import generate_latest

    registry = refs.engine_metrics().registry
    page = pages["reference/metrics.md"]
    exposed = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    for row in refs.metric_rows():
        assert f"| `{row['name']}` |" in page
        for label in row["labels"]:
            assert f"`{label}`" in page
    for name in exposed:
        if name.endswith("_created"):
            continue
        assert f"`{name}`" in page or f"`{re.sub(r'_(bucket|sum|count)$', '', name)}_bucket`" in page, name


def test_metric_names_on_hand_written_pages_exist(refs) -> None:
    """A metric a page names (l3worker:xxx, with its exposed suffix) is one the engine exports."""
    series = {s for row in refs.metric_rows() for s in row["series"]} | {r["name"] for r in refs.metric_rows()}
    for path in doc_files():
        for name in set(re.findall(r"l3worker:[a-z_:]+[a-z]", path.read_text())):
            if name.endswith("_total_") or name.startswith("l3worker:spec_decode_num_accepted_tokens_per_pos"):
                name = name.rstrip("_")
            assert name in series or name.rstrip("_") in series, f"{path.relative_to(ROOT)} names {name}"


def test_flags_on_hand_written_pages_exist(refs) -> None:
    """Every `--flag` a page names in backticks belongs to some l3worker command (or is a vLLM flag
    named as refused, or an example script's)."""
    known = {s for _, p in refs.leaf_commands() for a in p._actions for s in a.option_strings}
    known |= {f"--no-{s[2:]}" for s in known if s.startswith("--")}
    from l3worker.serving.vllm_flags import VLLM_SERVE_FLAGS

    known |= set(VLLM_SERVE_FLAGS) | {"--goodput"}  # vllm bench's, named on benchmarks.md as not carried over
    scripts = "\n".join(p.read_text() for p in [*(ROOT / "examples").glob("*.py"), *(ROOT / "scripts").glob("*.py")])
    for path in doc_files():
        text = path.read_text()
        for flag in set(re.findall(r"`(--[a-z][a-z0-9-]*)", text)):
            base = flag.split("=")[0]
            if base.endswith("-"):  # a family, `--prefix-repetition-*`
                continue
            assert base in known or f'"{base}"' in scripts or base.startswith("--[no-]"), \
                f"{path.relative_to(ROOT)} names {flag}, which no command has"


def test_api_reference_lists_every_field_and_argument(pages) -> None:
    import l3worker

    page = pages["reference/python-api.md"]
    for p in list(inspect.signature(l3worker.DistributedWorker.__init__).parameters)[1:]:
        assert f"    {p}" in page, p
    for name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        for f in dataclasses.fields(getattr(l3worker, name)):
            assert f"| `{f.name}` |" in page, (name, f.name)


def test_usage_pages_cover_the_worker_and_sampling_params() -> None:
    """The hand-written tables name every argument and field (their defaults are generated)."""
    import l3worker

    offline = (DOCS / "usage" / "offline.md").read_text()
    for p in list(inspect.signature(l3worker.DistributedWorker.__init__).parameters)[1:]:
        if p != "fault_injection":  # a test hook
            assert f"`{p}`" in offline, p
    sampling = (DOCS / "usage" / "sampling-params.md").read_text()
    for f in dataclasses.fields(l3worker.SamplingParams):
        assert f"`{f.name}`" in sampling, f.name


def test_pages_speak_of_the_project_alone() -> None:
    """No page speaks of commits, changes or internal targets."""
    banned = re.compile(r"\bcommits?\b|before this (change|commit)|\btargets?\b (is|are|was|were|of|met)|"
                        r"the \d\.\d+ target|\b(this|our|the previous|last) session\b", re.I)
    for path in doc_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if m := banned.search(line):
                if "revision (branch, tag or commit)" in line:
                    continue
                pytest.fail(f"{path.relative_to(ROOT)}:{n}: {m[0]!r}: {line.strip()}")
