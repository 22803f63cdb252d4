"""From API requests to what engine.generate takes: prompt token ids and SamplingParams.

Every check here names the request's field and the limit, so a client gets a 400 it can act on
before anything reaches the engine; the engine's own checks still stand behind these."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from l3worker.lora import LoRARequest
from l3worker.params import SamplingParams
from l3worker.structured.reasoning import THINK_END
from l3worker.structured.specs import StructuredSpec, tool_choice_spec
from l3worker.structured.tool_parsers import TOOL_CALL_START
from l3worker.serving.openai.chat import ChatTemplate, ChatTemplateError, tool_call_for_template
from l3worker.serving.openai.adapters import ServedAdapters
from l3worker.serving.openai.chat_reply import ChatParsing
from l3worker.serving.openai.errors import bad_request, model_not_found
from l3worker.serving.openai.generation_config import GenerationDefaults, RequestSeeds
from l3worker.serving.openai.protocol import (MAX_TOP_LOGPROBS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                      TokenizeRequest, _Sampling)
from l3worker.serving.openai.tokens import Tokens

request_log = logging.getLogger("l3worker.serving.received")  # --enable-log-requests


@dataclass
class ServedModel:
    """What the API needs to know of the engine's model."""

    names: tuple[str, ...]  # --served-model-name, else the model as named; the first is the one reported
    model_dir: str
    max_model_len: int
    vocab_size: int
    tokens: Tokens | None
    chat_template: ChatTemplate | None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    parsing: ChatParsing = field(default_factory=ChatParsing)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: a request's default
    root: str = ""  # /v1/models' root: the model as the user named it (path or Hub id)
    max_logprobs: int = MAX_TOP_LOGPROBS  # --max-logprobs
    response_role: str = "assistant"  # --response-role
    seeds: RequestSeeds = field(default_factory=RequestSeeds)  # --seed
    log_requests: bool = False  # --enable-log-requests
    adapters: ServedAdapters = field(default_factory=ServedAdapters)  # LoRA adapters by name (--lora-modules)

    def resolve(self, requested: str | None) -> str:
        """The name to answer with: the first served name, as vLLM reports it whichever alias a
        request used, or the LoRA adapter's name; 404 for a model this server does not serve."""
        if requested in self.adapters.by_name:
            return requested
        if requested is not None and requested != "" and requested not in self.names:
            raise model_not_found(requested)
        return self.names[0]

    def lora_of(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's "model" names; None: the base model."""
        return self.adapters.get(requested)

    def log_request(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """--enable-log-requests: what each request asked for, as vLLM logs it."""
        if self.log_requests:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_log.info("Received request %s%s: prompt_token_ids: %s, params: %s", request_id,
                                 f"-{i}" if len(prompts) > 1 else "", prompt, p)

    # -- prompts ------------------------------------------------------------------------------------
    def encode(self, text: str, param: str) -> list[int]:
        if self.tokens is None:
            raise bad_request(f"{param}: this model has no tokenizer.json, so prompts must be token ids", param)
        return self.tokens.encode(text)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(f"{param}: token id {t} outside [0, {self.vocab_size}) (vocab_size)", param)
        return ids

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self.check_ids(self.encode(p, "prompt"), "prompt")]
        if not p:
            raise bad_request("prompt: empty list", "prompt")
        if all(isinstance(t, int) for t in p):
            return [self.check_ids(list(p), "prompt")]
        prompts = []
        for i, item in enumerate(p):
            param = f"prompt[{i}]"
            prompts.append(self.check_ids(self.encode(item, param) if isinstance(item, str) else list(item), param))
        return prompts

    def render_chat(self, messages: list[ChatMessage], *, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None,
                    continue_final_message: bool = False) -> str:
        if self.chat_template is None:
            raise bad_request("this model has no chat template (no chat_template in tokenizer_config.json); "
                              "start the server with --chat-template PATH, or use /v1/completions", "messages")
        if self.tokens is None:
            raise bad_request("this model has no tokenizer.json, so chat messages cannot be tokenized", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        kwargs = dict(kwargs or {})
        for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs: {reserved!r} is set by the request itself",
                                  "chat_template_kwargs")
        dicts = [_message_dict(m, i) for i, m in enumerate(messages)]
        try:
            text = self.chat_template.render(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        return _open_final_message(text, dicts[-1].get("content")) if continue_final_message and dicts else text

    def chat_text(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        return self.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                kwargs=req.chat_template_kwargs, continue_final_message=req.continue_final_message)

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest, text: str | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """The prompt's ids; `text` when the caller already rendered it."""
        text = self.chat_text(req) if text is None else text
        return self.check_ids(self.tokens.encode(text, add_special_tokens=add_special_tokens), "messages")

    def chat_role(self, req: ChatCompletionRequest) -> str:
        """The reply's role, vLLM's rule: --response-role after a generation prompt, else the last message's."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    def parses_tools(self, req: ChatCompletionRequest) -> bool:
        """Whether tool calls are parsed from the reply. tool_choice defaults to "auto" when tools are
        given (vLLM's rule), which needs --enable-auto-tool-choice; "none" shows the tools to the
        template and parses nothing."""
        if not req.tools:
            return False
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if choice == "none":
            return False
        if choice == "auto" and not self.parsing.auto_tool_choice:
            raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                              "--tool-call-parser", "tool_choice")
        return True

    def token_ids_as_text(self, req: _Sampling) -> bool:
        """return_tokens_as_token_ids: the request's, else the server's."""
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def check_logprobs(self, n: int | None, param: str, kind: str = "sample") -> None:
        """vLLM's --max-logprobs refusal (a 400 naming the field)."""
        if n is not None and n > self.max_logprobs:
            raise bad_request(f"{param}: Requested {kind} logprobs of {n}, which is greater than max allowed: "
                              f"{self.max_logprobs} (--max-logprobs)", param)

    def check_length(self, prompt_len: int, max_new_tokens: int, prompt_param: str, max_param: str) -> None:
        """vLLM's wording: the prompt plus the completion must fit in --max-model-len."""
        total = prompt_len + max_new_tokens
        if prompt_len + max(max_new_tokens, 1) > self.max_model_len:  # scoring still runs one step
            param = prompt_param if prompt_len >= self.max_model_len else max_param
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens (--max-model-len). However, "
                f"you requested {total} tokens ({prompt_len} in the {prompt_param}, {max_new_tokens} in the "
                f"completion). Please reduce the length of the {prompt_param} or the completion ({max_param}).",
                param, "context_length_exceeded")

    # -- sampling ----------------------------------------------------------------------------------
    def structured(self, req: _Sampling, prompt: Sequence[int], tools: list[dict[str, Any]] | None = None,
                   tool_choice: Any = None) -> dict[str, Any]:
        """The request's structured-output constraint as SamplingParams fields (none: {}); a 400
        naming the field for an invalid schema, regex, grammar or tool_choice."""
        try:
            spec = StructuredSpec.from_request(req.response_format, req.structured_outputs, req.guided_json,
                                               req.guided_regex, req.guided_choice, req.guided_grammar)
            forced = tool_choice_spec(tools or [], tool_choice, self._tags_are_tokens())
        except ValueError as e:
            named = [f for f in _STRUCTURED_FIELDS if f in str(e)]
            raise bad_request(str(e), min(named, key=str(e).index) if named else None) from None
        except (KeyError, TypeError, AttributeError):
            raise bad_request("tools: each tool must be {\"type\": \"function\", \"function\": {\"name\", "
                              "\"parameters\"}}", "tools") from None
        if forced is not None and spec is not None:
            raise bad_request(f"tool_choice: {tool_choice!r} holds the output to a tool call, and {spec.field} "
                              "cannot hold it as well", "tool_choice")
        spec = forced or spec
        if spec is None:
            return {}
        if self.tokens is None:
            raise bad_request(f"{spec.field}: structured outputs need the model's tokenizer.json", spec.field)
        return {"structured_outputs": spec, "reasoning_end_token_id": self._grammar_after(prompt)}

    @property
    def reasoning_end_id(self) -> int | None:
        """With --reasoning-parser: `</think>`'s id, after which a structured-output constraint applies."""
        if self.parsing.reasoning_parser is None or self.tokens is None:
            return None
        return self.tokens.tokenizer.token_to_id(THINK_END)

    def _tags_are_tokens(self) -> bool:
        return self.tokens is not None and self.tokens.tokenizer.token_to_id(TOOL_CALL_START) is not None

    def _grammar_after(self, prompt: Sequence[int]) -> int | None:
        """reasoning_end_id, unless the prompt ends with a closed think block (thinking disabled):
        then the constraint applies from the first token."""
        end = self.reasoning_end_id
        ends = [i for i, t in enumerate(prompt) if t == end]
        if end is None or not ends:
            return end
        return end if self.tokens.decode(list(prompt[ends[-1] + 1:])).strip() else None

    def sampling_params(self, req: _Sampling, *, max_new_tokens: int, max_param: str, logprobs: int | None,
                        logprobs_param: str, prompt_logprobs: int | None = None,
                        structured: dict[str, Any] | None = None) -> SamplingParams:
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        for kind, n in (("sample", logprobs), ("prompt", prompt_logprobs)):
            self.check_logprobs(n, logprobs_param, kind)
        d = self.defaults
        top_k = req.top_k if req.top_k is not None else d.top_k
        if top_k == -1:  # vLLM's spelling of "disabled"
            top_k = 0
        stop = req.stop if req.stop is not None else ()
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=_first(req.temperature, d.temperature),
            top_p=_first(req.top_p, d.top_p),
            top_k=top_k,
            min_p=_first(req.min_p, d.min_p),
            seed=req.seed if req.seed is not None else self.seeds.next(),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            presence_penalty=_first(req.presence_penalty, 0.0),
            frequency_penalty=_first(req.frequency_penalty, 0.0),
            repetition_penalty=_first(req.repetition_penalty, d.repetition_penalty),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=req.n,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            priority=req.priority,
            stream_interval=req.stream_interval,
            **(structured or {}),
        )
        try:
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise _renamed(str(e), {"max_tokens": max_param, "prompt_logprobs": logprobs_param,
                                   "logprobs": logprobs_param}) from None
        return params

    def completion_params(self, req: CompletionRequest, prompt_len: int, prompt: Sequence[int] = ()) -> SamplingParams:
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}); choosing the best of several samples is not "
                              "supported", "best_of")
        max_new = req.max_tokens if req.max_tokens is not None else max(self.max_model_len - prompt_len, 0)
        if max_new < 0:
            raise bad_request(f"max_tokens must be >= 0, got {max_new}", "max_tokens")
        prompt_logprobs = None
        if req.echo and (req.logprobs is not None or max_new == 0):
            prompt_logprobs = req.logprobs or 0  # echo reports the prompt's logprobs; max_tokens=0 only scores it
        if max_new == 0 and not req.echo:
            raise bad_request("max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", "max_tokens")
        self.check_length(prompt_len, max_new, "prompt", "max_tokens")
        return self.sampling_params(req, max_new_tokens=max_new, max_param="max_tokens", logprobs=req.logprobs,
                                    logprobs_param="logprobs", prompt_logprobs=prompt_logprobs,
                                    structured=self.structured(req, prompt))

    def chat_params(self, req: ChatCompletionRequest, prompt_len: int, prompt: Sequence[int] = ()) -> SamplingParams:
        """`prompt`: the ids, which tell whether a constraint starts after the reasoning."""
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = _first(req.max_completion_tokens, req.max_tokens)
        max_new = requested if requested is not None else max(self.max_model_len - prompt_len, 0)
        if max_new < 1:
            raise bad_request(f"{max_param} must be >= 1, got {max_new}", max_param)
        if req.top_logprobs is not None:
            if req.top_logprobs < 0:
                raise bad_request(f"top_logprobs must be >= 0, got {req.top_logprobs}", "top_logprobs")
            self.check_logprobs(req.top_logprobs, "top_logprobs")
            if req.top_logprobs > 0 and not req.logprobs:
                raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        self.check_length(prompt_len, max_new, "messages", max_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self.sampling_params(req, max_new_tokens=max_new, max_param=max_param, logprobs=logprobs,
                                    logprobs_param="top_logprobs",
                                    structured=self.structured(req, prompt, req.tools, req.tool_choice))


def _first(*values):
    for v in values:
        if v is not None:
            return v
    return None


_LEADING_NAME = re.compile(r"^([a-z_]+)")
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "tool_choice", "tools")


def _renamed(message: str, names: dict[str, str]):
    """SamplingParams' message, in the API's field names; param is the field it starts with."""
    for engine_name, api_name in names.items():
        message = re.sub(rf"\b{engine_name}\b", api_name, message)
    m = _LEADING_NAME.match(message)
    return bad_request(message, m.group(1) if m else None)


def _open_final_message(text: str, final: Any) -> str:
    """continue_final_message, as transformers does it: the rendered chat cut right after the last
    message's content, so that the model continues that message."""
    final = final if isinstance(final, str) else ""
    for piece in (final, final.strip()):
        if piece and piece in text:
            return text[:text.rindex(piece) + len(piece)]
    raise bad_request("continue_final_message: the final message's content does not appear in the chat the "
                      "template rendered", "continue_final_message")


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message as the template sees it: plain data, content parts joined into one string, and an
    assistant's tool-call arguments as an object (as vLLM passes them; the API sends JSON text)."""
    out = m.model_dump(exclude_unset=False)
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [tool_call_for_template(c) for c in out["tool_calls"]]
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{i}].content[{j}]: content of type {part.type!r} is not supported "
                                  "(text only)", f"messages[{i}].content")
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    return out
