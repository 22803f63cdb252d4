"""POST /v1/chat/completions: messages rendered through the chat template, then one engine request."""
from __future__ import annotations


from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from l3worker.params import RequestOutput
from l3worker.server.engine_client import EngineClient, merge, unless_disconnected
from l3worker.server.protocol import ChatCompletionRequest
from l3worker.server.responses import TokenFormatter, new_id, now, sse, sse_stream, usage
from l3worker.server.translate import ServedModel


class _Job:
    def __init__(self, req: ChatCompletionRequest, model_name: str, fmt: TokenFormatter):
        self.req = req
        self.model_name = model_name
        self.request_id = new_id("chatcmpl")
        self.created = now()
        self.fmt = fmt
        self.final: RequestOutput | None = None
        self.top_n = req.top_logprobs or 0

    def logprobs(self, lps) -> dict | None:
        return self.fmt.chat_logprobs(lps or [], self.top_n) if self.req.logprobs else None

    def usage(self) -> dict:
        o = self.final
        if o is None:
            return usage(0, 0, 0)
        return usage(len(o.prompt_token_ids), sum(len(s.token_ids) for s in o.outputs), o.num_cached_tokens)

    def chunk(self, choices: list[dict], include_usage: bool) -> str:
        body = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model_name, "choices": choices}
        if include_usage:
            body["usage"] = None
        return sse(body)

    def log_line(self) -> str:
        u = self.usage()
        reasons = sorted({s.finish_reason for s in self.final.outputs if s.finish_reason}) if self.final else []
        return (f"{self.request_id} n={self.req.n} prompt_tokens={u['prompt_tokens']} "
                f"completion_tokens={u['completion_tokens']} finish={','.join(reasons) or '-'}")


async def create_chat_completion(request: Request, req: ChatCompletionRequest, model: ServedModel,
                                 client: EngineClient) -> Response:
    model_name = model.resolve(req.model)
    prompt = model.chat_prompt(req)
    params = model.chat_params(req, len(prompt))
    job = _Job(req, model_name, TokenFormatter(model.tokens))
    request.scope["l3worker.log"] = job.log_line
    outputs = merge([client.generate(prompt, params, job.request_id)])
    if req.stream:
        first = await unless_disconnected(request, anext(outputs))
        return StreamingResponse(_stream(job, first[1], outputs), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(request, _whole(job, outputs)))


async def _whole(job: _Job, outputs) -> dict:
    async for _, out in outputs:
        if out.finished:
            job.final = out
    choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text or "", "refusal": None},
                "logprobs": job.logprobs(s.logprobs), "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
               for s in sorted(job.final.outputs, key=lambda s: s.index)]
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": job.model_name,
            "choices": choices, "usage": job.usage()}


async def _stream(job: _Job, first: RequestOutput, outputs):
    include_usage = bool(job.req.stream_options and job.req.stream_options.include_usage)
    finished: set[int] = set()

    def events(out: RequestOutput) -> str:
        if out.finished:
            job.final = out
        frames = []
        for s in out.outputs:
            if s.index in finished:
                continue
            if not s.delta_text and not s.delta_token_ids and s.finish_reason is None:
                continue
            delta = {"content": s.delta_text} if s.delta_text or s.finish_reason is None else {}
            if s.finish_reason is not None:
                finished.add(s.index)
            frames.append(job.chunk([{"index": s.index, "delta": delta, "logprobs": job.logprobs(s.delta_logprobs),
                                      "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}],
                                    include_usage))
        return "".join(frames)

    async def frames():
        # Every choice opens with the assistant role, as OpenAI's stream does.
        yield "".join(job.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], include_usage) for i in range(job.req.n))
        yield events(first)
        async for _, out in outputs:
            if frame := events(out):
                yield frame

    def usage_chunk() -> dict:
        return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
                "model": job.model_name, "choices": [], "usage": job.usage()}

    async for event in sse_stream(frames(), outputs, usage_chunk if include_usage else None, job.request_id):
        yield event
