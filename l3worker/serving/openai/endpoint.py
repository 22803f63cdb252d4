"""What the generation endpoints share: their engine requests started and merged, the client's
disconnect watched until the answer starts, the response envelope, usage, the request's log line
and SSE framing. An endpoint (completions.py, chat_completions.py) writes only what differs: its
prompts and sampling parameters, and the shape of a whole choice and of a streamed one.

Every response tells the weights' version (SGLang's weight_version, l3worker/worker/rollout.py) as
a top-level "weight_version": a whole response once, a stream in each chunk that ends a choice (the
one with its finish_reason) and in the usage chunk, as the version is when that chunk is written.

Aborts: a client that leaves before the answer starts is noticed here (`unless_disconnected`);
one that leaves mid-stream, by the framework, which cancels the stream. Either way the engine's
streams are closed, and closing a stream aborts its request in the engine's own front
(AsyncEngine.generate); no other layer aborts."""
from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import AsyncIterator, Awaitable, Callable, ClassVar, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from l3worker.lora import LoRARequest
from l3worker.params import CompletionOutput, RequestOutput, SamplingParams
from l3worker.serving.openai.engine_client import EngineClient, merge
from l3worker.serving.openai.errors import APIError, internal
from l3worker.serving.openai.protocol import _Sampling
from l3worker.serving.openai.responses import SSE_DONE, TokenFormatter, new_id, now, sse, usage

log = logging.getLogger("l3worker.serving")
T = TypeVar("T")
Outputs = AsyncIterator[tuple[int, RequestOutput]]


class ClientDisconnected(Exception):
    """The client went away before the response started; its requests were aborted."""


class Generation(ABC):
    """One API request that generates: several prompts (completions) or one (chat), each with `n`
    samples; choice `i * n + s.index` is sample `s` of prompt `i`."""

    object: ClassVar[str]  # the whole response's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's
    id_prefix: ClassVar[str]

    def __init__(self, req: _Sampling, model_name: str, prompts: list[list[int]], fmt: TokenFormatter):
        self.req = req
        self.model_name = model_name
        self.prompts = prompts
        self.fmt = fmt
        self.request_id = new_id(self.id_prefix)
        self.created = now()
        self.finals: dict[int, RequestOutput] = {}  # by prompt index
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self._finished: set[int] = set()  # choices whose finish_reason was streamed
        self.weight_version: Callable[[], str] = lambda: "default"  # respond() asks the engine
        self.lora: LoRARequest | None = None  # the LoRA adapter its "model" names

    # -- what an endpoint writes -----------------------------------------------------------------
    @abstractmethod
    def choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict:
        """A whole choice, from the final output of prompt `i`."""

    @abstractmethod
    def delta_choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict | None:
        """A streamed choice with what is new in `s`; None when there is nothing to send."""

    def delta_choices(self, i: int, out: RequestOutput, s: CompletionOutput) -> list[dict]:
        """The streamed choices for what is new in `s`, each sent in a chunk of its own, in order."""
        choice = self.delta_choice(i, out, s)
        return [] if choice is None else [choice]

    def opening(self) -> list[dict]:
        """Choices sent each in a chunk of its own before the first output."""
        return []

    def log_fields(self) -> str:
        return f"n={self.req.n}"

    # -- shared ------------------------------------------------------------------------------------
    def index(self, i: int, s: CompletionOutput) -> int:
        return i * self.req.n + s.index

    def usage(self) -> dict:
        finals = self.finals.values()
        return usage(sum(len(o.prompt_token_ids) for o in finals),
                     sum(len(s.token_ids) for o in finals for s in o.outputs),
                     sum(o.num_cached_tokens for o in finals))

    def log_line(self) -> str:
        reasons = sorted({s.finish_reason for o in self.finals.values() for s in o.outputs if s.finish_reason})
        u = self.usage()
        return (f"{self.request_id} {self.log_fields()} prompt_tokens={u['prompt_tokens']} "
                f"completion_tokens={u['completion_tokens']} finish={','.join(reasons) or '-'}")

    def envelope(self, object_: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model_name,
                "choices": choices}

    def whole(self) -> dict:
        choices = [self.choice(i, out, s) for i, out in sorted(self.finals.items())
                   for s in sorted(out.outputs, key=lambda s: s.index)]
        return {**self.envelope(self.object, choices), "usage": self.usage(), "weight_version": self.weight_version()}

    def chunk(self, choice: dict) -> str:
        body = self.envelope(self.chunk_object, [choice])
        if self.include_usage:
            body["usage"] = None
        if choice.get("finish_reason") is not None:
            body["weight_version"] = self.weight_version()
        return sse(body)

    def usage_chunk(self) -> str:
        return sse({**self.envelope(self.chunk_object, []), "usage": self.usage(),
                    "weight_version": self.weight_version()})

    def events(self, i: int, out: RequestOutput) -> str:
        """The chunks of one engine output: one per choice with something new."""
        if out.finished:
            self.finals[i] = out
        frames = []
        for s in out.outputs:
            index = self.index(i, s)
            if index in self._finished:
                continue
            choices = self.delta_choices(i, out, s)
            if choices and s.finish_reason is not None:
                self._finished.add(index)
            frames.extend(self.chunk(choice) for choice in choices)
        return "".join(frames)


def nothing_new(s: CompletionOutput) -> bool:
    return not s.delta_text and not s.delta_token_ids and s.finish_reason is None


async def respond(request: Request, gen: Generation, client: EngineClient, params: list[SamplingParams]) -> Response:
    """Runs `gen`'s prompts in the engine and answers with the whole response or its SSE stream.
    Errors before the first output (the engine's input checks) are answered as errors, not streamed."""
    request.scope["l3worker.log"] = gen.log_line
    gen.weight_version = lambda: client.weight_version
    rid = gen.request_id
    single = len(gen.prompts) == 1
    outputs = merge([client.generate(p, sp, rid if single else f"{rid}-{i}", gen.lora)
                     for i, (p, sp) in enumerate(zip(gen.prompts, params))])
    if gen.req.stream:
        first = await unless_disconnected(request, anext(outputs))
        return StreamingResponse(_stream(gen, first, outputs), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(request, _whole(gen, outputs)))


async def _whole(gen: Generation, outputs: Outputs) -> dict:
    async for i, out in outputs:
        if out.finished:
            gen.finals[i] = out
    return gen.whole()


async def _stream(gen: Generation, first: tuple[int, RequestOutput], outputs: Outputs) -> AsyncIterator[str]:
    """The stream's events: the opening chunks, a chunk per choice with something new, then the
    usage chunk when asked for, or an error event if it fails; always [DONE] last, with the
    engine's outputs closed (aborting what still runs)."""
    try:
        if opening := gen.opening():
            yield "".join(gen.chunk(choice) for choice in opening)
        yield gen.events(*first)
        async for i, out in outputs:
            if frame := gen.events(i, out):
                yield frame
        if gen.include_usage:
            yield gen.usage_chunk()
    except APIError as e:
        yield sse(e.body())
    except Exception:
        log.exception("%s failed while streaming", gen.request_id)
        yield sse(internal().body())
    finally:
        await outputs.aclose()
    yield SSE_DONE


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientDisconnected (after cancelling it, which closes and so aborts
    its requests) if the client closes the connection first. Needs the body to have been read."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientDisconnected()
