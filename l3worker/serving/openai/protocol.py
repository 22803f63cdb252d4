"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling fields) and the error body.

Unknown fields are ignored, as vLLM does; fields this server cannot honour are declared so that a
request using them gets a 400 naming the field instead of a silently different answer."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields that /v1/completions and /v1/chat/completions share."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None  # None: the checkpoint's generation_config.json, else 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    # vLLM's extras
    top_k: int | None = None  # 0 or -1 disables
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (l3worker.structured.specs reads and checks them; at most one per request)
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    guided_json: Any = None  # vLLM's older fields
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"; None: the server's
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority; must be 0 otherwise
    stream_interval: int | None = None  # vLLM's: tokens per streamed chunk (at least the server's)


def _check_prompt(value: Any) -> Any:
    """One message for every wrong shape, instead of one per member of the union."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str) or ids(value):
        return value
    if isinstance(value, list) and all(isinstance(p, str) or (ids(p) and p) for p in value):
        return value
    raise ValueError("must be a string, a list of token ids, or a list of those (strings or lists of token ids)")


class CompletionRequest(_Sampling):
    prompt: Annotated[str | list[int] | list[str | list[int]], BeforeValidator(_check_prompt)]
    max_tokens: int | None = 16  # null: up to --max-model-len
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # refused unless equal to n
    suffix: str | None = None  # refused


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """Passed to the chat template as given, with content parts joined into one string."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the template; calls parsed unless tool_choice is "none"
    # "required" and a named function ({"type": "function", "function": {"name"}}) hold the output to
    # the tool-call format with structured outputs
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last message (add_generation_prompt=false)
    add_special_tokens: bool = False  # the tokenizer's own specials around the rendered chat
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt (TokenizeCompletionRequest), or chat messages rendered through the
    template (TokenizeChatRequest), in one body."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults, true for a prompt and false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
