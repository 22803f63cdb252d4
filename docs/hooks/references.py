"""MkDocs hook: the reference pages that are generated at build time, so they cannot drift.

- `reference/cli-serve.md`, `reference/cli-bench.md`: every `l3worker` subcommand's flags, walked
  from the argparse parsers that `l3worker` itself builds (l3worker/serving/cli.py: build_parser,
  which adds l3worker/bench/cli.py's), grouped as the parser groups them, with the verbatim
  `--help` text.
- `reference/metrics.md`: every Prometheus metric of the engine's registry
  (l3worker/engine/metrics.py: EngineMetrics), with its type, labels and help text.

The generators are plain functions (no MkDocs import), so tests/docs/test_docs_references.py
checks them without building the site. mkdocs.yml names this file under `hooks:`.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import inspect
import json
import os
import re
from typing import Iterator

# Environment variables the parsers read for their defaults: never let a builder's secrets or
# terminal width reach the pages.
_ENV_DEFAULTS = ("L3WORKER_API_KEY", "OPENAI_API_KEY")
HELP_WIDTH = "100"


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in _ENV_DEFAULTS if k in os.environ}
    saved_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        yield
    finally:
        os.environ.update(saved)
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns


def _parser() -> argparse.ArgumentParser:
    from l3worker.serving.cli import build_parser

    with _clean_environment():
        return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def leaf_commands(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every runnable subcommand as ("serve" | "bench serve" | ..., its parser), in the parser's order."""
    parser = parser or _parser()
    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        subs = _subcommands(p)
        if not subs:
            found.append((" ".join(path), p))
        for name, sub in subs.items():
            walk(sub, path + [name])

    walk(parser, [])
    return found


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of a parser (positionals by their metavar), help left out."""
    names = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names.extend(action.option_strings or [action.metavar or action.dest])
    return names


def _md(text: str) -> str:
    """Text for a table cell: HTML and Markdown's emphasis characters escaped outside `code`."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside backticks
        p = html.escape(parts[i], quote=False)
        parts[i] = re.sub(r"([*_\[\]|])", r"\\\1", p)
    return "`".join(parts).replace("\n", " ")


def _expand_help(action: argparse.Action, prog: str) -> str:
    """The help text as --help prints it (%(default)s and the like filled in)."""
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    params = dict(vars(action), prog=prog)
    for name in list(params):
        if params[name] is argparse.SUPPRESS:
            del params[name]
        elif hasattr(params[name], "__name__"):
            params[name] = params[name].__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return action.help % params


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if isinstance(action, argparse.BooleanOptionalAction):
        return {True: "on", False: "off", None: "unset"}.get(action.default, str(action.default))
    default = action.default
    if default is None or default is argparse.SUPPRESS:
        return ""
    if isinstance(default, (list, tuple)):
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):  # given as separate words
            return " ".join(str(d) for d in default)
        return json.dumps(list(default))  # one value, a list (the CORS flags' JSON)
    return str(default)


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._format_action_invocation(action)


def command_markdown(name: str, parser: argparse.ArgumentParser) -> str:
    """One subcommand: its description, a table of flags per argument group, and --help verbatim."""
    lines = [f"## `l3worker {name}`", ""]
    if parser.description:
        lines += [_md(parser.description), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "options"
        lines += [f"### {title[0].upper()}{title[1:]} (`{name}`)", ""]
        if group.description:
            lines += [_md(group.description), ""]
        lines += ["| flag | default | description |", "| --- | --- | --- |"]
        for action in actions:
            help_text = _expand_help(action, parser.prog)
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
                choices = ", ".join(f"`{c}`" for c in action.choices)
                help_text = f"{help_text} (one of {choices})" if help_text else f"one of {choices}"
            default = _default(action)
            lines.append(f"| `{_invocation(parser, action)}` | {f'`{default}`' if default else ''} | {_md(help_text)} |")
        lines.append("")
    lines += [f'??? note "`l3worker {name} --help`, verbatim"', "",
              "    ```text"]
    lines += [f"    {line}".rstrip() for line in parser.format_help().splitlines()]
    lines += ["    ```", ""]
    return "\n".join(lines)


def cli_pages() -> dict[str, str]:
    """{page path: Markdown}: one page per top-level command (serve, bench), every leaf command on it."""
    with _clean_environment():
        parser = _parser()
        by_top: dict[str, list[str]] = {}
        for name, sub in leaf_commands(parser):
            by_top.setdefault(name.split()[0], []).append(command_markdown(name, sub))
    intro = {
        "serve": "The flags of `l3worker serve`, generated from the command's own argparse parser when this "
                 "site was built: the same text `l3worker serve --help` prints. For what each group is for, see "
                 "[The OpenAI server](../usage/server.md); for vLLM's names, [Coming from vLLM](../coming-from-vllm.md).",
        "bench": "The flags of `l3worker bench serve | throughput | latency`, generated from the command's own "
                 "argparse parsers when this site was built. How to use them: [Benchmarks](../benchmarks.md).",
    }
    pages = {}
    for top, sections in by_top.items():
        head = [f"# `l3worker {top}` reference", "",
                intro.get(top, f"The flags of `l3worker {top}`, generated from its argparse parser."), ""]
        pages[f"reference/cli-{top}.md"] = "\n".join(head) + "\n" + "\n".join(sections)
    return pages


def engine_metrics():
    """A fresh EngineMetrics (its registry holds every metric the engine exports)."""
    from l3worker.engine.metrics import EngineMetrics

    params = inspect.signature(EngineMetrics).parameters.values()
    args = [(lambda: 0) for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    metrics = EngineMetrics(*args)
    metrics.track_lora(lambda: (1, [], []))  # with enable_lora
    return metrics


def metric_rows() -> list[dict]:
    """Every metric of the engine's registry: name, type, labels, help, and the series it exposes."""
    from l3worker.distributed.kv_event_feed import router_metrics

    registry = engine_metrics().registry
    rows = []
    for collector in [*registry._collector_to_names, *router_metrics().registry._collector_to_names]:
        name, kind = collector._name, collector._type
        labels = list(collector._labelnames)
        series = {"counter": [f"{name}_total"], "gauge": [name],
                  "histogram": [f"{name}_bucket", f"{name}_sum", f"{name}_count"]}.get(kind, [name])
        rows.append(dict(name=name, type=kind, labels=labels, help=collector._documentation, series=series,
                         buckets=list(getattr(collector, "_upper_bounds", []))))
    return rows


def metrics_page() -> str:
    rows = metric_rows()
    lines = ["# Metrics reference", "",
             "Every metric `l3worker serve` exports at `GET /metrics`, generated from the engine's metric "
             "definitions (`l3worker/engine/metrics.py`) when this site was built. An offline worker holds the "
             "same registry as `w.engine.metrics.registry`. How to read them, and the Grafana dashboard: "
             "[Metrics](../observability/metrics.md).", "",
             "On `/metrics` every series also carries the label `engine` (`\"0\"` with one engine core; one value "
             "per engine with `--data-parallel-size`), vLLM's convention; the router's carry `api_server` instead. "
             "Counters also expose prometheus_client's "
             "`_created` series (the time the counter was made).", "",
             "| metric | type | labels | series on /metrics | description |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        per_server = "api_server" in r["labels"]  # an API server's own series, not an engine's
        labels = ", ".join(f"`{label}`" for label in ([] if per_server else ["engine"]) + r["labels"])
        series = "<br>".join(f"`{s}`" for s in r["series"])
        lines.append(f"| `{r['name']}` | {r['type']} | {labels} | {series} | {_md(r['help'])} |")
    lines.append("")
    histograms = [r for r in rows if r["buckets"]]
    if histograms:
        lines += ["## Histogram buckets", "", "Upper bounds in seconds (`+Inf` closes each):", ""]
        for r in histograms:
            bounds = ", ".join(f"{b:g}" for b in r["buckets"])
            lines += [f"- `{r['name']}`: {bounds}"]
        lines.append("")
    return "\n".join(lines)


def vllm_flags_page() -> str:
    """vLLM's `vllm serve` flags against `l3worker serve`'s: the ones it takes (with its help text),
    its own, and the ones it refuses by name (l3worker/serving/vllm_flags.py)."""
    from l3worker.serving.vllm_flags import VLLM_SERVE_FLAGS

    serve = dict(leaf_commands())["serve"]
    actions = [a for a in serve._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    shared = [a for a in actions if set(a.option_strings) & VLLM_SERVE_FLAGS]
    own = [a for a in actions if not set(a.option_strings) & VLLM_SERVE_FLAGS]
    implemented = {s for a in actions for s in a.option_strings}
    refused = sorted(f for f in VLLM_SERVE_FLAGS if f not in implemented)

    def row(a: argparse.Action) -> str:
        default = _default(a)
        return (f"| `{', '.join(a.option_strings)}` | {f'`{default}`' if default else ''} | "
                f"{_md(_expand_help(a, serve.prog))} |")

    lines = ["# vLLM's serve flags in l3worker", "",
             "Generated when this site was built from `l3worker serve`'s parser and the list of `vllm serve` "
             "flags l3worker knows (`l3worker/serving/vllm_flags.py`). vLLM's underscore spellings "
             "(`--max_model_len`) are accepted too. Where the meaning or default differs from vLLM's, the help "
             "text says so; [Coming from vLLM](../coming-from-vllm.md) explains the differences.", "",
             f"## Taken, with vLLM's name ({len(shared)})", "",
             "| flag | default | l3worker's help |", "| --- | --- | --- |", *map(row, shared), "",
             f"## l3worker's own ({len(own)})", "",
             "Flags vLLM does not have.", "",
             "| flag | default | l3worker's help |", "| --- | --- | --- |", *map(row, own), "",
             f"## Refused by name ({len(refused)})", "",
             "`l3worker serve` exits with status 2 and `l3worker does not support FLAG` for each of these, "
             "before anything loads, rather than ignoring a setting you asked for:", "",
             ", ".join(f"`{f}`" for f in refused), ""]
    return "\n".join(lines)


def _annotation(a) -> str:
    return "" if a is inspect.Parameter.empty else (a if isinstance(a, str) else inspect.formatannotation(a))


def _signature_block(name: str, func, skip_self: bool = True) -> list[str]:
    """`name(param: type = default, ...)`, one parameter a line, as a Python code block."""
    params = list(inspect.signature(func).parameters.values())
    if skip_self and params and params[0].name == "self":
        params = params[1:]
    body, star_done = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            body.append("    *,")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if (ann := _annotation(p.annotation)):
            text += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        body.append(f"    {text},")
    if not body:
        return ["```python", f"{name}()", "```"]
    return ["```python", f"{name}(", *body, ")", "```"]


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def _methods(cls, names: list[str], owner: str) -> list[str]:
    lines = []
    for name in names:
        func = getattr(cls, name, None)
        if func is None:
            continue
        if isinstance(func, property):
            lines += [f"### `{owner}.{name}` (property)", "", _doc(func.fget), ""]
            continue
        lines += [f"### `{owner}.{name}()`", "", *_signature_block(name, func), "", _doc(func), ""]
    return lines


def _fields_table(cls) -> list[str]:
    import dataclasses

    rows = ["| field | type | default |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f"`{f.default_factory()!r}`"  # type: ignore[misc]
        else:
            default = "required"
        rows.append(f"| `{f.name}` | `{_md_code(_annotation(f.type))}` | {default} |")
    return rows


def _md_code(text: str) -> str:
    return text  # a pipe inside a code span does not split a table cell


def python_api_page() -> str:
    """The public classes: signatures, fields with their defaults, and docstrings, from the code."""
    import l3worker
    from l3worker.engine.step_loop import Engine

    lines = ["# Python API reference", "",
             "Generated from the code when this site was built: signatures, defaults and docstrings of what "
             "`from l3worker import ...` gives. How to use them: [Offline inference](../usage/offline.md) and "
             "[Sampling parameters](../usage/sampling-params.md).", ""]
    llm = l3worker.LLM
    lines += ["## `LLM`", "", *_signature_block("LLM", llm.__init__), "", _doc(llm), "",
              *_methods(llm, ["generate", "chat", "get_tokenizer", "get_default_sampling_params", "close"], "LLM")]
    worker = l3worker.DistributedWorker
    lines += ["## `DistributedWorker`", "", *_signature_block("DistributedWorker", worker.__init__), "",
              _doc(worker), "",
              *_methods(worker, ["generate", "stream", "prepare", "close", "stats", "healthy"], "DistributedWorker")]
    for name in ("SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "TokenLogprob"):
        cls = getattr(l3worker, name)
        doc = _doc(cls)
        if doc.startswith(f"{name}("):  # the dataclass's generated docstring repeats the fields
            doc = ""
        lines += [f"## `{name}`", "", doc, "", *_fields_table(cls), ""]
    lines += ["## `Engine`", "", "The step loop, as `DistributedWorker.engine` (after `prepare()`).", "",
              *_methods(Engine, ["add_request", "abort", "step", "has_unfinished"], "Engine")]
    lines += ["## `AsyncEngine`", "", *_signature_block("AsyncEngine", l3worker.AsyncEngine.__init__), "",
              _doc(l3worker.AsyncEngine), "",
              *_methods(l3worker.AsyncEngine, ["start", "generate", "abort", "shutdown", "healthy"], "AsyncEngine")]
    lines += ["## Errors", "", "| exception | base | description |", "| --- | --- | --- |"]
    for name in sorted(n for n in dir(l3worker) if isinstance(getattr(l3worker, n), type)
                       and issubclass(getattr(l3worker, n), BaseException)):
        cls = getattr(l3worker, name)
        lines.append(f"| `{name}` | `{cls.__bases__[0].__name__}` | {_md(_doc(cls).split(chr(10) + chr(10))[0])} |")
    lines.append("")
    return "\n".join(lines)


def generated_pages() -> dict[str, str]:
    return {**cli_pages(), "reference/metrics.md": metrics_page(), "reference/vllm-flags.md": vllm_flags_page(),
            "reference/python-api.md": python_api_page()}


def on_files(files, config):
    """MkDocs event: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
