"""`l3worker serve [MODEL_DIR]`: the command line, with vLLM's flag names where one exists."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from chip_child.spec.config import SpeculativeConfig
from l3worker.bench.cli import add_bench_parser, bench_command
from l3worker.params import DEFAULT_BATCHED_TOKENS, SERVE_CPU_BATCHED_TOKENS
from l3worker.serving.openai.chat_reply import REASONING_PARSERS, TOOL_CALL_PARSERS
from l3worker.distributed.dp_link import DpLayout
from l3worker.serving.openai.middleware import DEFAULT_MAX_BODY_BYTES
from l3worker.distributed.router import ROUTINGS
from l3worker.serving.runner import ModelInfo, ServeOptions, SignalStop, bind, serve, served_model

log = logging.getLogger("l3worker.serving")
DEFAULT_MAX_WAITING = 4096  # enough for any burst a single worker can serve in reasonable time
# Data-parallel engines on other nodes: vLLM's flags (l3worker/distributed/dp_link.py).
DP_NODE_FLAGS = ("--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                 "--data-parallel-rpc-port")


def dp_layout(args: argparse.Namespace) -> DpLayout:
    """Which data-parallel ranks this command runs, from the flags (checked by data_parallel_refusal)."""
    return DpLayout(args.data_parallel_size, args.data_parallel_size_local, args.data_parallel_start_rank or 0,
                    args.data_parallel_address, args.data_parallel_rpc_port, headless_dp(args))


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
    if getattr(args, "nnodes", 1) > 1:
        given = [f for f in DP_NODE_FLAGS if _given(args, f)]
        if given:
            return f"{', '.join(given)} with --nnodes: tensor parallel across nodes serves one engine"
        if args.data_parallel_size > 1:
            return "--data-parallel-size with --nnodes: tensor parallel across nodes serves one engine"
    return dp_layout(args).refusal()


def _device_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-ids takes comma-separated integers, got {text!r}") from None


def _speculative_config(text: str) -> dict:
    """The JSON object of --speculative-config, checked: a bad one is a usage error naming the key."""
    try:
        return SpeculativeConfig.of(text).to_dict()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="l3worker", description="l3worker: an LLM decode runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(commands)
    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve a Qwen3 checkpoint (or, without MODEL_DIR, the built-in tiny model) "
                                        "over an OpenAI-compatible HTTP API.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json) or Hugging Face Hub id "
                        "(org/name, fetched into the hub cache; HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply); "
                        "omitted: the built-in tiny model")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of MODEL")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="hub cache to download MODEL into (default: huggingface_hub's, under HF_HOME)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use (default: the directory's name; l3worker-tiny for the "
                        "built-in model)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="batch rows: requests decoded at once (default: 16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per request (default: 4096, or less if the model's "
                        "max_position_embeddings is less)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV-cache page (default: 128)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV-cache pages in all (default: room for --max-model-len in every row)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu (default: auto)")
    p.add_argument("--device-ids", type=_device_ids, default=None, metavar="IDS",
                   help="comma-separated ids of this node's devices; several: tensor parallel (default: 0, or "
                        "0 .. N-1 for N ranks per node)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks over all nodes (default: one per --device-ids entry)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the tensor-parallel ranks span (default: 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank; 0 is the head (default: 0)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="the head's address: torch.distributed rendezvous and the followers' commands "
                        "(default: %(default)s)")
    p.add_argument("--master-port", type=int, default=None,
                   help="the rendezvous port on the head; follower node R takes its commands on "
                        "--master-port + R (needed with --nnodes > 1)")
    p.add_argument("--headless", action="store_true",
                   help="no HTTP: a tensor-parallel follower node (--node-rank >= 1), or with --data-parallel-* "
                        "flags this node's data-parallel engines, served by the head")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    p.add_argument("--pipeline-depth", type=int, default=2, help="step commands in flight (default: 2)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"tokens per step: decoding rows plus prefill chunks (default: the larger of "
                        f"--max-num-seqs and {SERVE_CPU_BATCHED_TOKENS} on a cpu, {DEFAULT_BATCHED_TOKENS} "
                        "on an accelerator)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes seen before (default: on)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help="requests that may wait for a batch row; more are answered 503 (default: %(default)s)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of the chip-children after one dies, raises or hangs, within --restart-window-s; "
                        "every request resumes (default: %(default)s; 0: a failure stops the engine)")
    p.add_argument("--restart-window-s", type=float, default=600.0, metavar="S",
                   help="the window --max-restarts counts in (default: %(default)s)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' (default: off)')
    p.add_argument("--cpu-prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="cpu linear layers on oneDNN with weights prepacked at load (default: on where it runs)")
    p.add_argument("--quantization", default=None, metavar="METHOD",
                   help="quantize a plain checkpoint's linear weights at load: fp8 (128x128 block scales, the "
                        "Qwen3-*-FP8 format); a stored fp8 checkpoint is already quantized")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models over several --device-ids: split the experts across the ranks instead of "
                        "each expert's intermediate dimension")
    p.add_argument("--cpu-layout", choices=("auto", "every_core", "spare_core"), default="auto",
                   help="cpu: every_core (a thread per core), spare_core (a core left for the server and the "
                        "sockets) or auto (by the model's size, checked by a start-up trial; default)")
    p.add_argument("--api-key", default=os.environ.get("L3WORKER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $L3WORKER_API_KEY; none: no key)")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file (default: the checkpoint's)")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: sampling defaults from the checkpoint's generation_config.json; vllm: OpenAI's")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat replies' <think> block into reasoning_content / reasoning")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the format of the model's tool calls (hermes: <tool_call>{json}</tool_call>)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls into tool_calls when a request's tool_choice is auto (needs "
                        "--tool-call-parser)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' unless a request sets return_tokens_as_token_ids")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="API server processes sharing the listening socket, each with its own connection to the "
                        "engine-core process (default: %(default)s)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine-core processes, each with its share of --device-ids (on a cpu, of the cores), "
                        "behind the API server(s) (default: %(default)s)")
    p.add_argument("--data-parallel-routing", choices=ROUTINGS, default="cache_aware",
                   help="which engine a request goes to: the one holding the longest prefix of its prompt unless "
                        "it is busier than the least loaded by half a batch (cache_aware), the least loaded, or "
                        "in turn (default: %(default)s)")
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="M",
                   help="data-parallel engines on this node (default: --data-parallel-size on the head, the ranks "
                        "from --data-parallel-start-rank on with --headless); the head waits for the others")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None, metavar="R",
                   help="--headless: the first data-parallel rank of this node's engines (ranks R .. R+M-1)")
    p.add_argument("--data-parallel-address", "-dpa", default=None, metavar="ADDR",
                   help="the head's address, where engines on other nodes connect (it listens there)")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None, metavar="P",
                   help="the head's port for engines on other nodes (tcp)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    return parser


def serve_batched_tokens(args: argparse.Namespace) -> int | None:
    """--max-num-batched-tokens, or the serving default on a cpu (short chunks keep the running
    rows' inter-token latency low); None leaves the worker's default (accelerators)."""
    from chip_child.device import device_type

    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    try:
        kind = device_type(args.device)
    except ValueError:
        return None  # the worker names the bad device
    return max(SERVE_CPU_BATCHED_TOKENS, args.max_num_seqs) if kind == "cpu" else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.command == "serve":
        refusal = data_parallel_refusal(args)
        if refusal:
            parser.error(refusal)
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

    if args.headless:
        return headless_dp_command(args) if headless_dp(args) else headless_command(args)
    from l3worker import DistributedWorker  # heavy imports after the arguments are known good
    from l3worker.serving.launcher import DataParallel, launch_api_servers, launch_core

    layout = dp_layout(args)
    try:
        model_dir, max_model_len, builtin = _resolve_model(args)
        # A Hub id is served under that id (vLLM's habit), a directory under its name.
        names = args.served_model_name or ([args.model_dir] if not builtin and not os.path.isdir(args.model_dir) else [])
        worker_kwargs = _worker_kwargs(args, model_dir, max_model_len, builtin)
        if args.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
        dp = DataParallel(args.data_parallel_size, args.data_parallel_routing, layout.local)
        # Checks every argument and reads the model here, before any process starts; each engine
        # core makes (and prepares) its own worker from the same arguments.
        worker = DistributedWorker(**dp.engine_kwargs(worker_kwargs, 0))
        router = dp.router(args.block_size, worker.runtime_config.total_pages - 1, args.max_num_seqs)
        options = ServeOptions(host=args.host, port=args.port, served_model_names=tuple(names),
                               api_key=args.api_key or None, chat_template=args.chat_template,
                               generation_config=args.generation_config, max_body_bytes=DEFAULT_MAX_BODY_BYTES,
                               uvicorn_log_level=args.uvicorn_log_level,
                               reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                               enable_auto_tool_choice=args.enable_auto_tool_choice,
                               return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                               enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
        model = served_model(worker, options)
        remote = None if not layout.remote else dict(  # what the relay for the other ranks needs
            endpoint=layout.endpoint(), startup_timeout_s=worker.startup_timeout_s or 600.0,
            expected=dict(dp_size=dp.size, model=worker.model_name, max_model_len=worker.runtime_config.max_seq_len,
                          vocab_size=worker.model_config.vocab_size))
    except (ValueError, TypeError, OSError) as e:
        print(f"l3worker serve: {e}", file=sys.stderr)
        return 2
    info = ModelInfo.of(worker)
    worker.close()  # never prepared: it started nothing
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"l3worker serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    if model.defaults.overrides():
        log.info("sampling defaults from generation_config.json: %s", model.defaults.overrides())

    def on_ready(running) -> None:
        if stop.requested:
            return
        print(f"l3worker serve: ready at {running.url} serving {model.names[0]} (model {model.model_dir}, "
              f"max_num_seqs {args.max_num_seqs}, max_model_len {model.max_model_len}"
              f"{', chat template' if model.chat_template else ', no chat template'}"
              f"{f', cpu layout {client.cpu_layout}' if client.cpu_layout else ''}"
              f"{', API key required' if options.api_key else ''}"
              f"{f', {args.api_server_count} API servers' if args.api_server_count > 1 else ''}"
              f"{f', {dp.size} engines ({dp.routing})' if dp.size > 1 else ''})", flush=True)

    launch = None
    try:
        launch, client = launch_core(worker_kwargs, args.api_server_count, dp, router, remote)
        launch_api_servers(launch, args.api_server_count, sock, info, options, router)
        if launch.relay is not None:  # a stop while waiting for engines on other nodes ends the wait
            stop.before_server = lambda: launch.relay.send_signal(signal.SIGTERM)
            if stop.requested:  # it came before the line above
                stop.before_server()

        async def on_stop() -> None:
            launch.signal_api_servers()

        asyncio.run(serve(client, model, options, sock, on_ready=on_ready, on_server=stop.on_server, on_stop=on_stop))
    except Exception:
        if stop.requested and stop.server is None:  # stopped before it served: nothing failed
            print("l3worker serve: stopped while starting", flush=True)
            return 0
        log.exception("l3worker serve failed")
        return 1
    finally:
        if launch is not None:
            launch.kill()  # a no-op after an orderly stop
    print("l3worker serve: stopped", flush=True)
    return 0


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


def _worker_kwargs(args: argparse.Namespace, model_dir: str, max_model_len: int, builtin: bool) -> dict:
    """Every engine core's DistributedWorker arguments (before its share of the devices)."""
    return dict(model_dir=None if builtin else model_dir, device=args.device,
                device_ids=None if args.device_ids is None else list(args.device_ids), max_batch_size=args.max_num_seqs,
                max_seq_len=max_model_len, page_size=args.block_size,
                num_pages=args.num_gpu_blocks_override, dtype=args.dtype,
                pipeline_depth=args.pipeline_depth, max_num_batched_tokens=serve_batched_tokens(args),
                enable_prefix_caching=args.enable_prefix_caching, cpu_prepack=args.cpu_prepack,
                cpu_layout=args.cpu_layout,
                quantization=args.quantization, enable_expert_parallel=args.enable_expert_parallel,
                max_restarts=args.max_restarts, restart_window_s=args.restart_window_s,
                max_waiting_requests=args.max_waiting_requests,
                speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr,
                master_port=args.master_port)


def headless_dp_command(args: argparse.Namespace) -> int:
    """This node's data-parallel engines for the head, until the head goes away or SIGTERM."""
    from l3worker import DistributedWorker
    from l3worker.distributed.dp_headless import run_headless
    from l3worker.distributed.dp_link import Registration
    from l3worker.serving.launcher import DataParallel

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
    registration = Registration(layout.start_rank, layout.size, info.model_name, info.max_seq_len, info.vocab_size)
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
