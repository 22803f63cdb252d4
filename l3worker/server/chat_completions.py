"""POST /v1/chat/completions: messages rendered through the chat template, then one engine request."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from l3worker.params import CompletionOutput, RequestOutput, TokenLogprob
from l3worker.server.endpoint import Generation, nothing_new, respond
from l3worker.server.engine_client import EngineClient
from l3worker.server.protocol import ChatCompletionRequest
from l3worker.server.responses import TokenFormatter
from l3worker.server.translate import ServedModel


class ChatCompletion(Generation):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        return self.fmt.chat_logprobs(lps or [], self.req.top_logprobs or 0) if self.req.logprobs else None

    def choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict:
        return {"index": self.index(i, s), "message": {"role": "assistant", "content": s.text or "", "refusal": None},
                "logprobs": self.logprobs(s.logprobs), "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason}

    def delta_choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict | None:
        if nothing_new(s):
            return None
        delta = {"content": s.delta_text} if s.delta_text or s.finish_reason is None else {}
        return {"index": self.index(i, s), "delta": delta, "logprobs": self.logprobs(s.delta_logprobs),
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}

    def opening(self) -> list[dict]:
        # Every choice opens with the assistant role, as OpenAI's stream does.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.req.n)]


async def create_chat_completion(request: Request, req: ChatCompletionRequest, model: ServedModel,
                                 client: EngineClient) -> Response:
    model_name = model.resolve(req.model)
    prompt = model.chat_prompt(req)
    params = model.chat_params(req, len(prompt), prompt)
    return await respond(request, ChatCompletion(req, model_name, [prompt], TokenFormatter(model.tokens)), client,
                         [params])
