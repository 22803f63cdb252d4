"""The FastAPI application: routes, each a thin call into the module that does its job."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from l3worker.serving.openai.chat_completions import create_chat_completion
from l3worker.serving.openai.completions import create_completion
from l3worker.serving.openai.endpoint import ClientDisconnected
from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.errors import APIError, bad_request
from l3worker.serving.openai.middleware import DEFAULT_MAX_BODY_BYTES, APIKey, BodyLimit, RequestLog
from l3worker.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                      error_body)
from l3worker.serving.openai.responses import now
from l3worker.serving.openai.tokenizer_info import tokenizer_info
from l3worker.serving.openai.translate import ServedModel


def create_app(engine, model: ServedModel, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_tokenizer_info: bool = False) -> FastAPI:
    client = EngineClient(engine)
    app = FastAPI(title="l3worker", docs_url=None, redoc_url=None)
    app.state.client = client
    app.state.model = model
    created = now()

    # Added innermost first: the request log is the outermost layer.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(APIKey, api_key=api_key)
    app.add_middleware(RequestLog)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        problems, params = [], []
        for err in e.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            params.append(_dotted(loc))
            problems.append(f"{_dotted(loc) or 'body'}: {str(err.get('msg')).removeprefix('Value error, ')}")
        return bad_request("; ".join(problems), params[0] if params else None).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> Response:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        request.scope["l3worker.disconnected"] = True
        return Response(status_code=204)  # never delivered: nobody is listening

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await create_completion(request, req, model, client)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(request, req, model, client)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "l3worker", "root": model.model_dir,
             "parent": None, "max_model_len": model.max_model_len} for name in model.names]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        model.resolve(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = model.chat_prompt(req)
        else:
            if model.tokens is None:
                raise bad_request("this model has no tokenizer.json", "prompt")
            ids = model.tokens.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [model.tokens.token_text(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}

    if enable_tokenizer_info:
        info = tokenizer_info(model.model_dir, model.chat_template)

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            return info

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        model.resolve(req.model)
        if model.tokens is None:
            raise bad_request("this model has no tokenizer.json", "tokens")
        for t in req.tokens:
            if not 0 <= t < model.vocab_size:
                raise bad_request(f"tokens: token id {t} outside [0, {model.vocab_size}) (vocab_size)", "tokens")
        return {"prompt": model.tokens.decode(req.tokens)}

    return app


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out
