"""What `LLM.generate` and `LLM.chat` take, as vLLM writes it, turned into engine prompts.

Prompts are text, vLLM's TextPrompt / TokensPrompt dicts, or (an l3worker extension) token-id lists
and arrays. Text is tokenized here, with the tokenizer's special tokens added as vLLM adds them
(DistributedWorker, which takes text too, adds none). Chat messages are normalized as vLLM's
LLM.chat does before the template sees them: text content parts joined into one string ("string"
content format) and a tool call's JSON arguments parsed into an object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypedDict

import numpy as np

from l3worker.engine.inputs import as_prompt_list
from l3worker.serving.openai.chat import tool_call_for_template


class TextPrompt(TypedDict):
    """vLLM's TextPrompt."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """vLLM's TokensPrompt; `prompt`, when given, is what the output reports as its prompt."""

    prompt: str


@dataclass
class EnginePrompt:
    """One prompt for the worker: token ids (or ids as the caller gave them), and its text if any."""

    ids: Any
    text: str | None


def engine_prompts(prompts: Any, encode) -> list[EnginePrompt]:
    """Every prompt of `prompts` (one or a list); `encode(text)` tokenizes text (None: the model has
    no tokenizer). Raises ValueError/TypeError naming `prompts[i]`."""
    if isinstance(prompts, dict):
        prompts = [prompts]
    out = []
    for i, p in enumerate(as_prompt_list(prompts)):
        where = f"prompts[{i}]"
        if isinstance(p, dict):
            out.append(_from_dict(p, where, encode))
        elif isinstance(p, str):
            out.append(EnginePrompt(_encoded(p, where, encode), p))
        else:
            out.append(EnginePrompt(p, None))  # ids: the worker checks them
    return out


def _from_dict(p: dict, where: str, encode) -> EnginePrompt:
    unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} not supported by l3worker (prompt, prompt_token_ids)")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}['prompt'] must be a str, got {type(text).__name__}")
    if "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple, np.ndarray)):
            raise TypeError(f"{where}['prompt_token_ids'] must be a list of ints, got {type(ids).__name__}")
        return EnginePrompt(ids, text)
    if text is None:
        raise ValueError(f"{where}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return EnginePrompt(_encoded(text, where, encode), text)


def _encoded(text: str, where: str, encode) -> list[int]:
    if encode is None:
        raise ValueError(f"{where} is text but the model has no tokenizer.json; pass token ids")
    return encode(text)


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of messages) or a list of them, as a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
    return [list(c) for c in messages] if isinstance(messages[0], (list, tuple)) else [list(messages)]


def template_messages(conversation: Sequence[Any], content_format: str, index: int) -> list[dict[str, Any]]:
    """A conversation as the chat template sees it: plain dicts; `content_format` "string" (vLLM's
    "auto" for text) joins text parts with newlines, "openai" makes every content a list of parts."""
    out = []
    for j, m in enumerate(conversation):
        where = f"messages[{index}][{j}]" if index >= 0 else f"messages[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where} must be a dict with a 'role'")
        m = dict(m)
        content = m.get("content")
        if content_format == "openai":
            if isinstance(content, str):
                m["content"] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            m["content"] = "\n".join(_part_text(part, f"{where}['content'][{k}]") for k, part in enumerate(content))
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [tool_call_for_template(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"{where}: content of type {kind!r} is not supported by l3worker (text only)")
