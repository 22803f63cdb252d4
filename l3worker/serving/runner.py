"""Runs the API: the engine's lifetime around uvicorn's, on a socket bound before the model loads.
The engine is an AsyncEngine over a worker in this process (ServerThread), an InlineEngine stepped
by this event loop (`l3worker serve --inline-engine`), or a CoreClient of an engine-core process
(`l3worker serve`, serving/launcher.py).

Stopping (SIGINT/SIGTERM in `l3worker serve`, or ServerThread.stop) first refuses new requests and
aborts those in flight, then lets uvicorn close its connections, then shuts the engine down, which
stops the chip-children and removes their socket directory."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

import uvicorn

from l3worker.serving.openai.adapters import ServedAdapters, runtime_updating_allowed
from l3worker.serving.openai.app import Cors, create_app
from l3worker.serving.openai.chat import ChatTemplate
from l3worker.serving.openai.chat_reply import ChatParsing
from l3worker.serving.openai.generation_config import GenerationDefaults, RequestSeeds
from l3worker.serving.openai.middleware import DEFAULT_MAX_BODY_BYTES
from l3worker.serving.openai.protocol import MAX_TOP_LOGPROBS
from l3worker.serving.openai.tokens import Tokens
from l3worker.serving.openai.translate import ServedModel
from l3worker.serving.stats_log import StatsLog

log = logging.getLogger("l3worker.serving")


@dataclass
class ServeOptions:
    """The server's side of `l3worker serve`'s flags (JSON-able: API servers 1..N-1 get them as JSON)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the model as named (ModelInfo.model_name)
    api_key: str | list[str] | None = None  # one key or several (vLLM's --api-key takes several)
    chat_template: str | None = None  # a file or the template itself; None: the checkpoint's
    generation_config: str = "auto"  # auto: generation_config.json's sampling defaults; vllm: none; or a folder
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    uvicorn_log_level: str = "warning"
    graceful_timeout_s: float = 10.0  # after aborting, how long connections may take to close
    reasoning_parser: str | None = None  # --reasoning-parser (qwen3)
    tool_call_parser: str | None = None  # --tool-call-parser (hermes)
    enable_auto_tool_choice: bool = False  # parse tool calls when tool_choice is "auto"
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" unless a request says otherwise
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    enable_sleep_mode: bool = False  # POST /sleep, POST /wake_up, GET /is_sleeping (the worker needs it too)
    enable_weight_updates: bool = False  # POST /update_weights_from_disk, /pause_generation, ...
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()  # --lora-modules: (name, path, base_model_name)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    seed: int | None = None  # --seed: seeds the requests that give none (generation_config.RequestSeeds)
    max_logprobs: int = MAX_TOP_LOGPROBS  # --max-logprobs
    response_role: str = "assistant"  # --response-role
    enable_log_requests: bool = False  # --enable-log-requests: each request's prompt and parameters
    disable_log_stats: bool = False  # --disable-log-stats: no periodic throughput line
    stats_interval_s: float = 10.0  # between two throughput lines (vLLM's interval)
    root_path: str = ""  # --root-path, behind a proxy that routes a path prefix here
    allowed_origins: tuple[str, ...] = ("*",)  # the CORS flags, vLLM's defaults
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    ssl_keyfile: str | None = None  # uvicorn's TLS options
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE

    @property
    def cors(self) -> Cors:
        return Cors(tuple(self.allowed_origins), self.allow_credentials, tuple(self.allowed_methods),
                    tuple(self.allowed_headers))


@dataclass
class ModelInfo:
    """What the API needs to know of the worker's model (an API server process has no worker)."""

    model_dir: str
    model_name: str  # the model as the user named it (path or Hub id), or the built-in model's name
    max_seq_len: int
    vocab_size: int
    root: str = ""  # /v1/models' root: model_name, or the built-in model's directory

    @classmethod
    def of(cls, worker) -> "ModelInfo":
        from chip_child.models.tiny_model import TINY_MODEL_SERVED_NAME  # torch: not before a worker exists

        builtin = worker.model_name == TINY_MODEL_SERVED_NAME
        return cls(str(worker.model_dir), worker.model_name, worker.runtime_config.max_seq_len,
                   worker.model_config.vocab_size, str(worker.model_dir) if builtin else worker.model_name)


def served_model(worker, options: ServeOptions, info: ModelInfo | None = None) -> ServedModel:
    """What the API serves, from the worker's model (`info`: what to tell of it, when not the
    worker's own); raises ValueError for a bad chat template, generation config or parser options."""
    return model_for(info or ModelInfo.of(worker), worker.tokenizer, options)


def model_for(info: ModelInfo, tokenizer, options: ServeOptions) -> ServedModel:
    model_dir = info.model_dir
    names = tuple(options.served_model_names) or (info.model_name,)
    return ServedModel(
        names=names, model_dir=str(model_dir), max_model_len=info.max_seq_len,
        vocab_size=info.vocab_size,
        tokens=Tokens(tokenizer) if tokenizer is not None else None,
        chat_template=ChatTemplate.load(model_dir, options.chat_template),
        defaults=GenerationDefaults.for_option(options.generation_config, model_dir),
        parsing=ChatParsing(options.reasoning_parser, options.tool_call_parser, options.enable_auto_tool_choice),
        return_tokens_as_token_ids=options.return_tokens_as_token_ids, root=info.root or info.model_name,
        max_logprobs=options.max_logprobs, response_role=options.response_role,
        seeds=RequestSeeds(options.seed), log_requests=options.enable_log_requests,
        adapters=ServedAdapters.of(tuple(tuple(m) for m in options.lora_modules)))


def run_server(main: Awaitable) -> None:
    """Runs a server's coroutine to its end on uvloop where it is installed (a dependency outside
    Windows, as for vLLM): its loop, with httptools parsing HTTP (uvicorn's http="auto"), took the
    API server's CPU per streamed token from about 680 to 530 us on the 2-core CI machine, time that
    otherwise comes out of a cpu child's steps. Without it: asyncio's loop, said in one log line."""
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: the server runs on asyncio's event loop")
        asyncio.run(main)
        return
    uvloop.run(main)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made with proto IPPROTO_TCP. asyncio turns Nagle's algorithm off only on
    connections whose socket says so, and socket.create_server's says 0: each streamed chunk then
    waited for the client's delayed ACK (+40 ms TTFT on a kept-alive connection)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn, with a hook that runs once when it is told to stop, before it waits on connections."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable):
        super().__init__(config)
        self._on_stop = on_stop
        self._stop_ran = False

    async def on_tick(self, counter: int) -> bool:
        if self.should_exit and not self._stop_ran:
            self._stop_ran = True
            await self._on_stop()
        return await super().on_tick(counter)


@dataclass
class Running:
    url: str
    engine: object
    model: ServedModel
    server: _Uvicorn


async def serve(engine, model: ServedModel, options: ServeOptions, sock: socket.socket, *,
                on_ready: Callable[[Running], None] | None = None,
                on_server: Callable[[_Uvicorn], None] | None = None,
                on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Starts `engine` (an AsyncEngine, or a CoreClient of an engine-core process), serves on `sock`
    until told to stop, then shuts all down. `on_stop` runs when the stop begins, before the
    server's own requests are aborted."""
    stats: StatsLog | None = None  # the periodic throughput line (--disable-log-stats: none)
    try:
        await engine.start()
        app = create_app(engine, model, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                         enable_tokenizer_info=options.enable_tokenizer_info_endpoint, cors=options.cors,
                         enable_sleep_mode=options.enable_sleep_mode,
                         enable_weight_updates=options.enable_weight_updates,
                         enable_lora_updates=runtime_updating_allowed(options.allow_runtime_lora_updating))
        config = uvicorn.Config(app, log_config=None, log_level=options.uvicorn_log_level, access_log=False,
                                lifespan="off", http="auto", ws="none",
                                timeout_graceful_shutdown=options.graceful_timeout_s, root_path=options.root_path,
                                ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile,
                                ssl_ca_certs=options.ssl_ca_certs, ssl_cert_reqs=options.ssl_cert_reqs)
        if not options.disable_log_stats:
            stats = StatsLog(engine, options.stats_interval_s)

        async def stopping() -> None:
            if on_stop is not None:
                await on_stop()
            await app.state.client.abort_all()

        server = _Uvicorn(config, stopping)
        if on_server is not None:
            on_server(server)  # from here on a stop request reaches the server
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        scheme = "https" if options.ssl_certfile else "http"
        if server.started and on_ready is not None:
            on_ready(Running(url_of(sock, scheme), engine, model, server))
        if server.started and stats is not None:
            stats.start()
        await task
    finally:
        if stats is not None:
            await stats.stop()
        await engine.shutdown()
        sock.close()


class ServerThread:
    """The server on a loopback port in a background thread of this process (tests, notebooks).
    `inline`: the server's event loop steps the engine (`--inline-engine`), not a thread of its own."""

    def __init__(self, worker, model: ServedModel | None = None, options: ServeOptions | None = None,
                 inline: bool = False):
        self.options = options or ServeOptions(host="127.0.0.1", port=0)
        self.inline = inline
        self.model = model or served_model(worker, self.options)
        self.worker = worker
        self.running: Running | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="l3worker-server", daemon=True)

    def _main(self) -> None:
        from l3worker.serving.async_engine import AsyncEngine
        from l3worker.serving.inline_engine import InlineEngine

        try:
            sock = bind(self.options.host, self.options.port)
            engine = (InlineEngine if self.inline else AsyncEngine)(self.worker)
            run_server(serve(engine, self.model, self.options, sock, on_ready=self._on_ready))
        except BaseException as e:  # reported to start()/stop()
            self.error = e
        finally:
            self._ready.set()

    def _on_ready(self, running: Running) -> None:
        self.running = running
        self._ready.set()

    def start(self, timeout_s: float = 300.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.running is None:
            raise RuntimeError(f"server did not start: {self.error!r}")
        return self

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def engine(self):
        return self.running.engine

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.running is not None:
            self.running.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("server thread did not stop")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
