"""Chat templates: found next to the checkpoint or given by path, rendered as transformers renders them.

The template is untrusted code from a model repository, so it runs in jinja2's immutable sandbox with
the environment transformers gives it: trim_blocks, lstrip_blocks, the loop-control extension, a
`tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`. The checkpoint's special
tokens (bos_token, eos_token, ...) are template variables, as in transformers."""
from __future__ import annotations

import codecs
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template failed on these messages (a 400: the messages are what the template refused)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _template_text(override: str | Path) -> tuple[str, str]:
    """--chat-template, as vLLM reads it: a file, or else the template itself written on one line
    (with its escapes, such as \\n, decoded); (source, origin)."""
    try:
        return Path(override).read_text(encoding="utf-8"), str(override)
    except (OSError, ValueError) as e:
        text = str(override)
        if isinstance(override, Path) or not any(c in text for c in "{}\n"):
            raise ValueError(f"--chat-template {text!r} looks like a file path, but it cannot be read: {e}") from None
        # Escapes are decoded as vLLM does; non-ASCII text would not survive that, so it stays as written.
        return (codecs.decode(text, "unicode_escape") if text.isascii() else text), "--chat-template"


def tool_call_for_template(call: Any) -> Any:
    """A tool call as chat templates expect it (and vLLM hands it over): its arguments as an
    object, where OpenAI-style messages hold them as JSON text; as written when they are not a
    JSON object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}} if isinstance(arguments, dict) else call


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "<string>"):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {origin}: syntax error on line {e.lineno}: {e.message}") from None

    @classmethod
    def load(cls, model_dir: str | Path, override: str | Path | None = None) -> "ChatTemplate | None":
        """The template for a checkpoint: `override` (a file) if given, else the checkpoint's
        chat_template.jinja, else tokenizer_config.json's chat_template; None when there is none."""
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            with config_path.open(encoding="utf-8") as f:
                loaded = json.load(f)
            config = loaded if isinstance(loaded, dict) else {}
        special = {name: tok for name in SPECIAL_TOKEN_NAMES if (tok := _token_content(config.get(name)))}
        if override is not None:
            source, origin = _template_text(override)
            return cls(source, special, origin)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        source = _template_from_config(config.get("chat_template"))
        return cls(source, special, str(config_path)) if source is not None else None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text. `kwargs` (chat_template_kwargs such as enable_thinking) are template
        variables and may override the special tokens, not the messages."""
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # the template's own errors and whatever its expressions raise on these inputs
            raise ChatTemplateError(f"chat template: {e}") from None
