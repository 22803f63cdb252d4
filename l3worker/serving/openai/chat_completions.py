"""POST /v1/chat/completions: messages rendered through the chat template, then one engine request.

With a reasoning parser (--reasoning-parser) the think block goes to `reasoning_content` and to
`reasoning` (vLLM's current name; clients read either); with tool calls parsed (see
ServedModel.parses_tools) hermes blocks become `tool_calls` and the finish_reason `tool_calls`."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from l3worker.params import CompletionOutput, RequestOutput, TokenLogprob
from l3worker.structured.reasoning import prompt_opens_think
from l3worker.serving.openai.chat_reply import ReplyReader, openai_tool_deltas
from l3worker.serving.openai.endpoint import Generation, nothing_new, respond
from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.protocol import ChatCompletionRequest
from l3worker.serving.openai.responses import TokenFormatter
from l3worker.serving.openai.translate import ServedModel


class ChatCompletion(Generation):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest

    def __init__(self, req: ChatCompletionRequest, model_name: str, prompts: list[list[int]], fmt: TokenFormatter,
                 reader: ReplyReader | None = None, role: str = "assistant"):
        super().__init__(req, model_name, prompts, fmt)
        self.role = role  # ServedModel.chat_role
        self.reader = reader  # None: the reply is all content, as the model wrote it
        self.readers: dict[int, ReplyReader] = {}  # streamed choices' parsers

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        return self.fmt.chat_logprobs(lps or [], self.req.top_logprobs or 0) if self.req.logprobs else None

    def _finish_reason(self, s: CompletionOutput, called: bool) -> str | None:
        # vLLM's rule: a reply with tool calls finished because of them, even if cut by the length limit.
        return "tool_calls" if called and s.finish_reason in ("stop", "length") else s.finish_reason

    def choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict:
        message = {"role": self.role, "content": s.text or "", "refusal": None}
        called = False
        if self.reader is not None:
            piece = self.reader.whole(s.text or "")
            message["content"] = piece.content
            self._reasoning_fields(message, piece.reasoning, always=True)
            if piece.tool_calls:
                message["tool_calls"] = piece.tool_calls
                called = True
        return {"index": self.index(i, s), "message": message, "logprobs": self.logprobs(s.logprobs),
                "finish_reason": self._finish_reason(s, called), "stop_reason": s.stop_reason}

    def delta_choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict | None:
        if nothing_new(s):
            return None
        delta = {"content": s.delta_text} if s.delta_text or s.finish_reason is None else {}
        return self._delta_choice(i, s, delta, self.logprobs(s.delta_logprobs), s.finish_reason)

    def delta_choices(self, i: int, out: RequestOutput, s: CompletionOutput) -> list[dict]:
        if self.reader is None or nothing_new(s):
            return super().delta_choices(i, out, s)
        reader = self.readers.setdefault(self.index(i, s), self.reader.fresh())
        piece = reader.feed(s.delta_text)
        if s.finish_reason is not None:
            piece.add(reader.finish())
        first: dict = {}
        self._reasoning_fields(first, piece.reasoning, always=False)
        if piece.content:
            first["content"] = piece.content
        deltas = [first]
        for n, calls in enumerate(openai_tool_deltas(piece.tool_calls)):
            if n == 0:
                first["tool_calls"] = calls
            else:
                deltas.append({"tool_calls": calls})
        logprobs = self.logprobs(s.delta_logprobs)
        if not first and len(deltas) == 1 and s.finish_reason is None and logprobs is None:
            return []  # everything new is held back (a tag may be starting)
        finish = self._finish_reason(s, reader.called)
        return [self._delta_choice(i, s, d, logprobs if n == 0 else None, finish if n == len(deltas) - 1 else None)
                for n, d in enumerate(deltas)]

    def _delta_choice(self, i: int, s: CompletionOutput, delta: dict, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
        return {"index": self.index(i, s), "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": s.stop_reason if finish_reason is not None else None}

    def _reasoning_fields(self, into: dict, reasoning: str | None, always: bool) -> None:
        if self.reader is not None and self.reader.reasoning and (always or reasoning):
            into["reasoning_content"] = into["reasoning"] = reasoning

    def opening(self) -> list[dict]:
        # Every choice opens with the reply's role, as OpenAI's stream does.
        return [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.req.n)]


async def create_chat_completion(request: Request, req: ChatCompletionRequest, model: ServedModel,
                                 client: EngineClient) -> Response:
    model_name = model.resolve(req.model)
    text = model.chat_text(req)
    prompt = model.chat_prompt(req, text, req.add_special_tokens)
    params = model.chat_params(req, len(prompt), prompt)
    reasoning = model.parsing.reasoning_parser is not None
    tools = model.parses_tools(req)
    reader = ReplyReader(reasoning, tools, reasoning and prompt_opens_think(text)) if reasoning or tools else None
    fmt = TokenFormatter(model.tokens, model.token_ids_as_text(req))
    gen = ChatCompletion(req, model_name, [prompt], fmt, reader, model.chat_role(req))
    model.log_request(gen.request_id, [prompt], [params])
    gen.lora = model.lora_of(req.model)
    return await respond(request, gen, client, [params])
