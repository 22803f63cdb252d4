"""The FastAPI application: routes, each a thin call into the module that does its job."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from l3worker.serving.openai.chat_completions import create_chat_completion
from l3worker.serving.openai.completions import create_completion
from l3worker.serving.openai.endpoint import ClientDisconnected
from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.errors import APIError, bad_request
from l3worker.serving.openai.middleware import DEFAULT_MAX_BODY_BYTES, APIKey, BodyLimit, RequestLog
from l3worker.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                      error_body)
from l3worker.serving.openai.responses import new_id, now
from l3worker.serving.openai.lora_routes import add_lora_routes
from l3worker.serving.openai.rollout_routes import add_rollout_routes
from l3worker.serving.openai.tokenization import detokenize, tokenize
from l3worker.serving.openai.tokenizer_info import tokenizer_info
from l3worker.serving.openai.translate import ServedModel


@dataclass(frozen=True)
class Cors:
    """vLLM's CORS flags and their defaults (--allowed-origins, --allow-credentials, ...)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def version() -> str:
    try:
        return metadata.version("l3worker")
    except metadata.PackageNotFoundError:
        return "unknown"


def create_app(engine, model: ServedModel, *, api_key: str | list[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_tokenizer_info: bool = False,
               cors: Cors = Cors(), enable_sleep_mode: bool = False, enable_weight_updates: bool = False,
               enable_lora_updates: bool = False) -> FastAPI:
    client = EngineClient(engine)
    app = FastAPI(title="l3worker", docs_url=None, redoc_url=None)
    app.state.client = client
    app.state.model = model
    created = now()

    # Added innermost first: the request log is the outermost layer; CORS answers preflights
    # before the key is asked for, and puts its headers on refusals too.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(APIKey, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_credentials=cors.allow_credentials, allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers))
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
        """vLLM's ModelList: every served name, its root the model as the user named it; and the
        weights' version (SGLang's weight_version: update_weights_from_disk sets it)."""
        base = [{"id": name, "object": "model", "created": created, "owned_by": "l3worker",
                 "root": model.root or model.model_dir, "parent": None, "max_model_len": model.max_model_len,
                 "permission": [_permission(created)], "weight_version": client.weight_version} for name in model.names]
        adapters = [{**base[0], "id": name, "root": lora.lora_path, "parent": lora.base_model_name or model.names[0],
                     "permission": [_permission(created)]} for name, lora in list(model.adapters.by_name.items())]
        return {"object": "list", "data": base + adapters}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.healthy else 503)

    # SageMaker's probe, which vLLM answers as /health, on both methods
    app.get("/ping", operation_id="ping_get")(health)
    app.post("/ping", operation_id="ping_post")(health)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def post_tokenize(req: TokenizeRequest) -> dict:
        return tokenize(req, model)

    @app.post("/detokenize")
    async def post_detokenize(req: DetokenizeRequest) -> dict:
        return detokenize(req, model)

    if enable_tokenizer_info:
        info = tokenizer_info(model.model_dir, model.chat_template)

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            return info

    add_rollout_routes(app, client, sleep=enable_sleep_mode, weight_updates=enable_weight_updates)
    if enable_lora_updates:
        add_lora_routes(app, client, model.adapters, model.names)

    return app


def _permission(created: int) -> dict:
    """vLLM's ModelPermission, with its values (an OpenAI field clients may still read)."""
    return {"id": new_id("modelperm"), "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out
