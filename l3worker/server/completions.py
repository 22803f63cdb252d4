"""POST /v1/completions: prompts (text or ids, one or several) to choices, whole or streamed."""
from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from l3worker.params import RequestOutput
from l3worker.server.engine_client import EngineClient, merge, unless_disconnected
from l3worker.server.protocol import CompletionRequest
from l3worker.server.responses import TokenFormatter, new_id, now, sse, sse_stream, usage
from l3worker.server.translate import ServedModel


@dataclass
class _Choice:
    offset: int = 0  # text_offset of the next token
    started: bool = False
    finished: bool = False


@dataclass
class _Job:
    req: CompletionRequest
    model_name: str
    request_id: str
    created: int
    prompts: list[list[int]]
    fmt: TokenFormatter
    choices: dict[int, _Choice] = field(default_factory=dict)
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    def echo_text(self, i: int, out: RequestOutput) -> str:
        if isinstance(self.req.prompt, str):
            return self.req.prompt
        if isinstance(self.req.prompt, list) and self.req.prompt and isinstance(self.req.prompt[i], str):
            return self.req.prompt[i]
        return self.fmt.decode(self.prompts[i])

    def piece(self, i: int, out: RequestOutput, sample, text: str, token_ids, token_logprobs, st: _Choice):
        """text and logprobs of what is new for one choice; the prompt first when echoing."""
        lp = None
        if not st.started and self.req.echo:
            text = self.echo_text(i, out) + text
            if self.req.logprobs is not None:
                plp = out.prompt_logprobs or [None] * len(self.prompts[i])
                entries = list(zip(self.prompts[i], plp))
                entries += list(zip(token_ids, token_logprobs or []))
                lp, st.offset = self.fmt.completion_logprobs(entries, st.offset)
        elif self.req.logprobs is not None:
            lp, st.offset = self.fmt.completion_logprobs(zip(token_ids, token_logprobs or []), st.offset)
        st.started = True
        return text, lp

    def usage(self) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in self.finals.values())
        completion = sum(len(s.token_ids) for o in self.finals.values() for s in o.outputs)
        cached = sum(o.num_cached_tokens for o in self.finals.values())
        return usage(prompt, completion, cached)

    def log_line(self) -> str:
        reasons = sorted({s.finish_reason for o in self.finals.values() for s in o.outputs if s.finish_reason})
        u = self.usage()
        return (f"{self.request_id} prompts={len(self.prompts)} n={self.req.n} prompt_tokens={u['prompt_tokens']} "
                f"completion_tokens={u['completion_tokens']} finish={','.join(reasons) or '-'}")


async def create_completion(request: Request, req: CompletionRequest, model: ServedModel,
                            client: EngineClient) -> Response:
    model_name = model.resolve(req.model)
    prompts = model.completion_prompts(req)
    params = [model.completion_params(req, len(p)) for p in prompts]
    job = _Job(req, model_name, new_id("cmpl"), now(), prompts, TokenFormatter(model.tokens))
    request.scope["l3worker.log"] = job.log_line
    rid = job.request_id
    streams = [client.generate(p, sp, rid if len(prompts) == 1 else f"{rid}-{i}")
               for i, (p, sp) in enumerate(zip(prompts, params))]
    outputs = merge(streams)
    if req.stream:
        first = await unless_disconnected(request, anext(outputs))
        return StreamingResponse(_stream(job, first, outputs), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(request, _whole(job, outputs)))


async def _whole(job: _Job, outputs) -> dict:
    async for i, out in outputs:
        if out.finished:
            job.finals[i] = out
    n = job.req.n
    choices = []
    for i in range(len(job.prompts)):
        out = job.finals[i]
        for s in sorted(out.outputs, key=lambda s: s.index):
            st = _Choice()
            text, lp = job.piece(i, out, s, s.text or "", s.token_ids, s.logprobs, st)
            choices.append({"index": i * n + s.index, "text": text, "logprobs": lp,
                            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason})
    return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model_name,
            "choices": choices, "usage": job.usage()}


async def _stream(job: _Job, first: tuple[int, RequestOutput], outputs):
    include_usage = bool(job.req.stream_options and job.req.stream_options.include_usage)
    n = job.req.n

    def events(i: int, out: RequestOutput) -> str:
        if out.finished:
            job.finals[i] = out
        frames = []
        for s in out.outputs:
            st = job.choices.setdefault(i * n + s.index, _Choice())
            if st.finished:
                continue
            text, lp = job.piece(i, out, s, s.delta_text, s.delta_token_ids, s.delta_logprobs, st)
            if not text and not s.delta_token_ids and s.finish_reason is None:
                continue
            st.finished = s.finish_reason is not None
            chunk = {"id": job.request_id, "object": "text_completion", "created": job.created,
                     "model": job.model_name,
                     "choices": [{"index": i * n + s.index, "text": text, "logprobs": lp,
                                  "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}]}
            if include_usage:
                chunk["usage"] = None
            frames.append(sse(chunk))
        return "".join(frames)

    async def frames():
        yield events(*first)
        async for i, out in outputs:
            if frame := events(i, out):
                yield frame

    def usage_chunk() -> dict:
        return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model_name,
                "choices": [], "usage": job.usage()}

    async for event in sse_stream(frames(), outputs, usage_chunk if include_usage else None, job.request_id):
        yield event
