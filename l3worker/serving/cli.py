"""`l3worker serve [MODEL]`: vLLM's `vllm serve` command line (the parser: serve_args.py), and
`l3worker bench`. A vLLM flag l3worker does not implement exits 2 naming it (vllm_flags.py); a parse
error prints the subcommand's usage."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from chip_child.step.row_fields import MAX_LOGPROBS
from l3worker.bench.cli import add_bench_parser, bench_command
from l3worker.distributed.dp_link import DpLayout
from l3worker.engine.kv_events import KVEventsConfig
from l3worker.serving.early_core import EarlyCore
from l3worker.serving.signal_stop import SignalStop
from chip_child.config import KV_CACHE_DTYPES
from l3worker.serving.serve_args import add_serve_parser, api_key_default
from l3worker.serving.vllm_flags import unsupported_flag, vllm_spelling

if TYPE_CHECKING:
    from l3worker.serving.runner import ServeOptions

log = logging.getLogger("l3worker.serving")
# Data-parallel engines on other nodes: vLLM's flags (l3worker/distributed/dp_link.py).
DP_NODE_FLAGS = ("--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                 "--data-parallel-rpc-port")


def dp_layout(args: argparse.Namespace) -> DpLayout:
    """Which data-parallel ranks this command runs, from the flags (checked by data_parallel_refusal)."""
    return DpLayout(args.data_parallel_size, args.data_parallel_size_local, args.data_parallel_start_rank or 0,
                    args.data_parallel_address, args.data_parallel_rpc_port, headless_dp(args),
                    args.data_parallel_silence_timeout)


def headless_dp(args: argparse.Namespace) -> bool:
    """--headless for data-parallel engines (any DP flag), not a tensor-parallel follower."""
    return bool(getattr(args, "headless", False)) and (
        args.data_parallel_size > 1 or any(_given(args, f) for f in DP_NODE_FLAGS))


def _given(args: argparse.Namespace, flag: str) -> bool:
    return getattr(args, flag[2:].replace("-", "_"), None) is not None


def data_parallel_refusal(args: argparse.Namespace) -> str | None:
    """Why these data-parallel arguments cannot be served, naming the flag, or None."""
    if args.data_parallel_size < 1:
        return f"--data-parallel-size must be >= 1, got {args.data_parallel_size}"
    if not args.data_parallel_silence_timeout > 1.0:  # above the one-second ping, or every link is lost
        return f"--data-parallel-silence-timeout must be > 1 second, got {args.data_parallel_silence_timeout}"
    if getattr(args, "nnodes", 1) > 1:
        given = [f for f in DP_NODE_FLAGS if _given(args, f)]
        if given:
            return f"{', '.join(given)} with --nnodes: tensor parallel across nodes serves one engine"
        if args.data_parallel_size > 1:
            return "--data-parallel-size with --nnodes: tensor parallel across nodes serves one engine"
    return dp_layout(args).refusal()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="l3worker", description="l3worker: an LLM decode runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(commands)
    add_serve_parser(commands)
    return parser


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


def serve_refusal(args: argparse.Namespace) -> str | None:
    """Why these serve flags cannot be served, naming the flag, or None (checked before anything loads)."""
    if args.model_flag is not None and args.model_dir not in (None, args.model_flag):
        return f"MODEL {args.model_dir!r} and --model {args.model_flag!r} name different models: give one"
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        return (f"--kv-cache-dtype {args.kv_cache_dtype}: l3worker supports {', '.join(KV_CACHE_DTYPES)} "
                "(fp8_e5m2 and calibrated scales are not implemented)")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        return f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        return f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's limit), got {args.max_logprobs}"
    if args.stream_interval < 1:
        return f"--stream-interval must be >= 1, got {args.stream_interval}"
    if args.seed is not None and not 0 <= args.seed < 2**63:
        return f"--seed must be in [0, 2**63), got {args.seed}"
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        return "--ssl-keyfile and --ssl-certfile go together"
    return data_parallel_refusal(args)


def parse_serve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with vLLM's spellings: exit 2 with the subcommand's usage for a vLLM flag
    l3worker does not implement (named), an unknown flag or a refused combination."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    serving = bool(argv) and argv[0] == "serve"
    if serving:
        argv = [argv[0], *(vllm_spelling(a) for a in argv[1:])]
        serve_parser = _serve_parser(parser)
        supported = {s for a in serve_parser._actions for s in a.option_strings}
        if flag := unsupported_flag(argv[1:], supported):
            serve_parser.error(f"l3worker does not support {flag}")
    args, extra = parser.parse_known_args(argv)
    if args.command != "serve":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args
    serve_parser = _serve_parser(parser)
    if extra:
        serve_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if refusal := serve_refusal(args):
        serve_parser.error(refusal)
    if args.model_flag is not None:  # vLLM's --model, the same as the positional MODEL
        args.model_dir = args.model_flag
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_serve_args(argv)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "bench":
        return bench_command(args)
    return 2


def serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.disable_log_requests:
        logging.getLogger("l3worker.serving.requests").setLevel(logging.WARNING)
    stop = SignalStop()
    early = EarlyCore.start(args)  # before the imports and checks below, which its own imports overlap
    try:
        return _serve(args, stop, early)
    finally:
        if early is not None:
            early.discard()  # a no-op once the launch took it


def _serve(args: argparse.Namespace, stop: SignalStop, early: EarlyCore | None) -> int:
    # The HTTP server's modules (uvicorn, FastAPI) and torch load only now: `--help` and a bad flag
    # answer without them.
    from l3worker.serving.runner import ModelInfo, bind, run_server, serve, served_model

    if args.headless:
        return headless_dp_command(args) if headless_dp(args) else headless_command(args)
    from chip_child.models.fingerprint import checkpoint_fingerprint
    from l3worker import DistributedWorker  # heavy imports after the arguments are known good
    from l3worker.serving.inline_engine import inline_refusal
    from l3worker.serving.launcher import DataParallel, launch_api_servers, launch_core

    layout = dp_layout(args)
    try:
        model_dir, max_model_len, builtin = _resolve_model(args)
        worker_kwargs = _worker_kwargs(args, model_dir, max_model_len, builtin)
        if args.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
        dp = DataParallel(args.data_parallel_size, args.data_parallel_routing, layout.local)
        # Checks every argument and reads the model here, before any process starts; each engine
        # core makes (and prepares) its own worker from the same arguments.
        worker = DistributedWorker(**dp.engine_kwargs(worker_kwargs, 0))
        router = dp.router(worker.runtime_config.page_size, worker.runtime_config.total_pages - 1, args.max_num_seqs,
                           KVEventsConfig.of(args.kv_events_config))
        options = serve_options(args)
        if args.inline_engine and (why := inline_refusal(args.api_server_count, dp.size,
                                                         layout.remote or getattr(args, "nnodes", 1) > 1)):
            raise ValueError(why)
        check_lora_serving(args, options, worker)
        # Served as typed, path or Hub id (vLLM's name), though the worker reads the resolved directory.
        info = ModelInfo.of(worker)
        if not builtin:
            info = replace(info, model_name=args.model_dir, root=args.model_dir)
        model = served_model(worker, options, info)
        remote = None if not layout.remote else dict(  # what the relay for the other ranks needs
            endpoint=layout.endpoint(), startup_timeout_s=worker.startup_timeout_s or 600.0,
            silence_s=layout.silence_s,
            expected=dict(dp_size=dp.size, model=Path(worker.model_dir).name,
                          max_model_len=worker.runtime_config.max_seq_len,
                          vocab_size=worker.model_config.vocab_size,
                          fingerprint=checkpoint_fingerprint(worker.model_dir)))
    except (ValueError, TypeError, OSError) as e:
        print(f"l3worker serve: {e}", file=sys.stderr)
        return 2
    if not args.inline_engine:
        worker.close()  # never prepared: it started nothing; each engine core makes its own
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"l3worker serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        worker.close()
        return 1
    if worker.kv_sizing is not None:
        log.info("KV cache: %s", worker.kv_sizing.describe())
    if model.defaults.overrides():
        log.info("%s", model.defaults.describe())

    routed_by = ", following their KV events" if router and router.events_endpoints else ""

    def on_ready(running) -> None:
        if stop.requested:
            return
        cfg = worker.runtime_config
        pages = cfg.total_pages - 1
        cpu_layout = worker.cpu_layout_in_use if args.inline_engine else client.cpu_layout
        step_core = worker.step_core if args.inline_engine else client.step_core
        print(f"l3worker serve: ready at {running.url} serving {model.names[0]} (model {model.model_dir}, "
              f"max_num_seqs {args.max_num_seqs}, max_model_len {model.max_model_len}, "
              f"kv cache {pages} pages of {cfg.page_size} ({pages * cfg.page_size} tokens"
              f"{f' from {worker.kv_sizing.source}' if worker.kv_sizing else ''}), "
              f"{model.defaults.describe()}"
              f"{', chat template' if model.chat_template else ', no chat template'}"
              f"{f', cpu layout {cpu_layout}' if cpu_layout else ''}"
              f"{f' (the step thread alone on core {step_core})' if step_core is not None else ''}"
              f"{', engine inline' if args.inline_engine else ''}"
              f"{', API key required' if options.api_key else ''}"
              f"{f', {args.api_server_count} API servers' if args.api_server_count > 1 else ''}"
              f"{f', {dp.size} engines ({dp.routing}{routed_by})' if dp.size > 1 else ''})", flush=True)

    if args.inline_engine:
        from l3worker.serving.inline_engine import InlineEngine

        stop.before_server = worker.engine.request_stop  # a stop while the children start ends their start
        return until_stopped(stop, lambda: run_server(serve(InlineEngine(worker), model, options, sock,
                                                            on_ready=on_ready, on_server=stop.on_server)),
                             worker.close)
    launch = client = None  # the engine cores and the other API servers, and the client of the cores

    def run() -> None:
        nonlocal launch, client
        launch, client = launch_core(worker_kwargs, args.api_server_count, dp, router, remote, early)
        launch_api_servers(launch, args.api_server_count, sock, info, options, router)
        # A stop while the engines load (or wait for the ones on other nodes) ends their start-up.
        stop.before_server = launch.stop_starting
        if stop.requested:  # it came before the line above
            stop.before_server()

        async def on_stop() -> None:
            launch.signal_api_servers()

        run_server(serve(client, model, options, sock, on_ready=on_ready, on_server=stop.on_server, on_stop=on_stop))

    def clean_up() -> None:
        if launch is not None:
            launch.kill()

    return until_stopped(stop, run, clean_up)


def until_stopped(stop, run: Callable[[], None], clean_up: Callable[[], None]) -> int:
    """Serves (`run`) until the server stops; `clean_up` runs then, a no-op after an orderly stop.
    Returns the exit status: 0 after a stop, also one before anything served, else 1."""
    try:
        run()
    except Exception:
        if stop.requested and stop.server is None:  # stopped before it served: nothing failed
            print("l3worker serve: stopped while starting", flush=True)
            return 0
        log.exception("l3worker serve failed")
        return 1
    finally:
        clean_up()
    print("l3worker serve: stopped", flush=True)
    return 0


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The HTTP server's part of the flags."""
    from l3worker.serving.openai.middleware import DEFAULT_MAX_BODY_BYTES
    from l3worker.serving.runner import ServeOptions

    api_key = args.api_key or api_key_default()
    return ServeOptions(
        host=args.host, port=args.port, served_model_names=tuple(args.served_model_name or ()),
        api_key=list(api_key) if isinstance(api_key, (list, tuple)) else api_key,
        chat_template=args.chat_template, generation_config=args.generation_config,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES, uvicorn_log_level=args.uvicorn_log_level,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint, seed=args.seed,
        enable_sleep_mode=args.enable_sleep_mode, enable_weight_updates=args.enable_weight_updates,
        lora_modules=tuple(args.lora_modules or ()), allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        max_logprobs=args.max_logprobs, response_role=args.response_role,
        enable_log_requests=args.enable_log_requests, disable_log_stats=args.disable_log_stats,
        root_path=args.root_path or "", allowed_origins=tuple(args.allowed_origins),
        allow_credentials=args.allow_credentials, allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def _resolve_model(args: argparse.Namespace) -> tuple[str, int, bool]:
    """The model's directory (the built-in one's, or the Hub's copy), its max_model_len, and whether it is built in."""
    from chip_child.models.loader import load_config
    from chip_child.models.tiny_model import ensure_tiny_model
    from l3worker.hub import resolve_model

    builtin = args.model_dir is None
    model_dir = str(ensure_tiny_model()) if builtin else resolve_model(args.model_dir, args.revision, args.download_dir)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(4096, load_config(model_dir).max_position_embeddings)
    return model_dir, max_model_len, builtin


_VLLM_DTYPES = {"float": "float32"}  # vLLM's other spelling


def check_lora_serving(args: argparse.Namespace, options: ServeOptions, worker) -> None:
    """--lora-modules read and checked now (a bad adapter stops the start, named); the flags'
    combinations vLLM would refuse, refused."""
    from l3worker.serving.openai.adapters import ServedAdapters, runtime_updating_allowed

    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if runtime_updating_allowed(args.allow_runtime_lora_updating) and args.api_server_count > 1:
        raise ValueError("runtime LoRA updating needs --api-server-count 1: each API server keeps its own adapter "
                         "names, so an adapter loaded through one would be unknown to the others")
    adapters = ServedAdapters.of(options.lora_modules)
    if len(adapters.by_name) != len(options.lora_modules):
        raise ValueError("--lora-modules: two adapters have the same name")
    for request in adapters.by_name.values():
        try:
            worker.add_lora(request)
        except ValueError as e:
            worker.close()  # its adapter copies go with it
            raise ValueError(f"--lora-modules {request.lora_name}: {e}") from None


def _worker_kwargs(args: argparse.Namespace, model_dir: str, max_model_len: int, builtin: bool) -> dict:
    """Every engine core's DistributedWorker arguments (before its share of the devices)."""
    return dict(model_dir=None if builtin else model_dir, device=args.device,
                device_ids=None if args.device_ids is None else list(args.device_ids), max_batch_size=args.max_num_seqs,
                max_seq_len=max_model_len, page_size=args.block_size,
                num_pages=args.num_gpu_blocks_override, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                dtype=_VLLM_DTYPES.get(args.dtype, args.dtype), decode_graphs=False if args.enforce_eager else None,
                pipeline_depth=args.pipeline_depth, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
                cpu_prepack=args.cpu_prepack,
                cpu_layout=args.cpu_layout,
                quantization=args.quantization, enable_expert_parallel=args.enable_expert_parallel,
                max_restarts=args.max_restarts, restart_window_s=args.restart_window_s,
                max_waiting_requests=args.max_waiting_requests, stream_interval=args.stream_interval,
                speculative_config=args.speculative_config, enable_sleep_mode=args.enable_sleep_mode,
                kv_events_config=args.kv_events_config, kv_cache_dtype=args.kv_cache_dtype,
                kv_offloading_size=args.kv_offloading_size, enable_lora=args.enable_lora, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr,
                master_port=args.master_port)


def headless_dp_command(args: argparse.Namespace) -> int:
    """This node's data-parallel engines for the head, until the head goes away or SIGTERM."""
    from chip_child.models.fingerprint import checkpoint_fingerprint
    from l3worker import DistributedWorker
    from l3worker.distributed.dp_headless import run_headless
    from l3worker.distributed.dp_link import Registration
    from l3worker.serving.launcher import DataParallel
    from l3worker.serving.runner import ModelInfo

    layout = dp_layout(args)
    try:
        model_dir, max_model_len, builtin = _resolve_model(args)
        worker_kwargs = _worker_kwargs(args, model_dir, max_model_len, builtin)
        dp = DataParallel(layout.size, local_size=layout.local, start_rank=layout.start_rank)
        worker = DistributedWorker(**dp.engine_kwargs(worker_kwargs, layout.start_rank))  # checks the arguments
        info = ModelInfo.of(worker)
        worker.close()  # never prepared: it started nothing
    except (ValueError, TypeError, OSError) as e:
        print(f"l3worker serve --headless: {e}", file=sys.stderr)
        return 2
    registration = Registration(layout.start_rank, layout.size, Path(info.model_dir).name, info.max_seq_len,
                                info.vocab_size, checkpoint_fingerprint(info.model_dir))
    return run_headless(layout, worker_kwargs, registration)


def headless_command(args: argparse.Namespace) -> int:
    """A follower node: this node's tensor-parallel ranks, until the head goes away or SIGTERM."""
    from l3worker.distributed.follower import FollowerOptions, run_follower
    from l3worker.distributed.nodes import NodeLayout

    try:
        layout = NodeLayout.of(args.tensor_parallel_size, args.device_ids, args.nnodes, args.node_rank,
                               args.master_addr, args.master_port)
        options = FollowerOptions(layout, args.model_dir, args.revision, args.download_dir, args.device,
                                  args.device_ids)
        return run_follower(options)
    except (ValueError, TypeError, OSError) as e:
        print(f"l3worker serve --headless: {e}", file=sys.stderr)
        return 2
