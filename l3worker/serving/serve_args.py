"""`l3worker serve`'s argument parser: vLLM's flag names, meanings and defaults where vLLM has the
flag, grouped as `vllm serve --help` groups them, every default shown by the formatter. Nothing
heavy is imported here: the parser is built on every `l3worker` call."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from chip_child.config import CPU_LAYOUTS, DEVICE_TYPES
from chip_child.spec.config import SpeculativeConfig
from l3worker.engine.kv_events import KVEventsConfig
from l3worker.distributed.dp_link import SILENCE_S
from l3worker.distributed.router import ROUTINGS
from l3worker.params import DEFAULT_BATCHED_TOKENS
from l3worker.serving.openai.chat_reply import REASONING_PARSERS, TOOL_CALL_PARSERS
from l3worker.serving.openai.protocol import MAX_TOP_LOGPROBS

DEFAULT_MAX_WAITING = 4096  # enough for any burst a single worker can serve in reasonable time
API_KEY_ENV = "L3WORKER_API_KEY"  # read when --api-key is not given (vLLM reads VLLM_API_KEY)


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


def _kv_events_config(text: str) -> dict | None:
    """The JSON object of --kv-events-config, checked by key (None when events stay off)."""
    try:
        config = KVEventsConfig.of(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return None if config is None else dataclasses.asdict(config)


def _human_int(text: str) -> int:
    """vLLM's spelling of --max-model-len and --kv-cache-memory-bytes: 4096, 32k (x1000) or 32K (x1024), 1m / 1M,
    4g / 4G."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number such as 4096, 32k or 32K, got {text!r}")
    number, unit = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]
    return int(float(number) * scale)


def _json_list(text: str) -> tuple[str, ...]:
    """vLLM's CORS flags take a JSON list, e.g. '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return tuple(value)


def add_serve_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (vLLM's `vllm serve` flags)",
        description="Serve a checkpoint (a directory or a Hugging Face Hub id; without one, the built-in tiny "
                    "model) over an OpenAI-compatible HTTP API. Flags are vLLM's where vLLM has them; vLLM flags "
                    "l3worker does not implement are refused by name.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, served under this name as typed: a checkpoint directory "
                        "(config.json, *.safetensors, tokenizer.json) or a Hub id (org/name, fetched into the hub "
                        "cache; HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply); omitted: the built-in tiny model")
    _model_args(p.add_argument_group("Model", "the checkpoint and how it is run (vLLM's ModelConfig)"))
    _cache_args(p.add_argument_group("Cache", "the KV cache (vLLM's CacheConfig)"))
    _parallel_args(p.add_argument_group("Parallel", "tensor and data parallelism (vLLM's ParallelConfig)"))
    _scheduler_args(p.add_argument_group("Scheduler", "batching (vLLM's SchedulerConfig)"))
    _lora_args(p.add_argument_group("LoRA", "LoRA adapters served beside the model (vLLM's LoRAConfig)"))
    _device_args(p.add_argument_group("Device", "where the chip-children run (l3worker)"))
    _frontend_args(p.add_argument_group("Frontend", "the HTTP server (vLLM's FrontendArgs)"))
    _logging_args(p.add_argument_group("Logging", "what the server logs (vLLM's engine logging flags)"))
    return p


def _lora_module(text: str) -> tuple[str, str, str | None]:
    """vLLM's --lora-modules item: name=path, or a JSON object with name, path and base_model_name."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
        unknown = set(value) - {"name", "path", "base_model_name"} if isinstance(value, dict) else set()
        if not isinstance(value, dict) or unknown or not value.get("name") or not value.get("path"):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}, "
                                             f"got {text!r}")
        return value["name"], value["path"], value.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path, None


def _lora_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT checkpoints)")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help='adapters served from the start, each name=path or \'{"name": ..., "path": ..., '
                        '"base_model_name": ...}\'; a request picks one with "model": NAME')
    g.add_argument("--max-loras", type=int, default=1, metavar="N", help="adapters in one batch (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the highest adapter rank taken")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters kept checked in host memory (None: --max-loras)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which also enables them)")


def _model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as the positional MODEL (give one or the other)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) requests may use; the first is the one responses report (None: MODEL as "
                        "typed; l3worker-tiny for the built-in model)")
    g.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of MODEL")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="hub cache to download MODEL into (None: huggingface_hub's, under HF_HOME)")
    g.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM's sake; l3worker never runs a checkpoint's own code and refuses a "
                        "config.json whose auto_map names an architecture it does not implement")
    g.add_argument("--dtype", default="auto",
                   help="auto | float32 (float) | bfloat16 | float16 (half); auto: the checkpoint's on an "
                        "accelerator, float32 on a cpu")
    g.add_argument("--max-model-len", type=_human_int, default=None, metavar="N",
                   help="prompt + completion tokens per request, e.g. 4096, 32k, 32K (None: 4096, or less if the "
                        "model's max_position_embeddings is less)")
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="quantize a plain checkpoint's linear weights at load: fp8 (128x128 block scales, the "
                        "Qwen3-*-FP8 format); a stored fp8 checkpoint is already quantized")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="no decode graphs (CUDA/NPU graphs of the decode step): every step runs eagerly")
    g.add_argument("--seed", type=int, default=None,
                   help="seeds the sampling of requests that give no seed of their own, reproducibly from "
                        "server start (None: unseeded)")
    g.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, metavar="N",
                   help=f"the most logprobs / top_logprobs a request may ask for (at most {MAX_TOP_LOGPROBS}); "
                        "more is a 400")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for fields a request leaves out: auto: the checkpoint's "
                        "generation_config.json; vllm: none (temperature 1, top_p 1, ...); a folder: its "
                        "generation_config.json")
    g.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' (None: off)')
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "publisher": '
                        '"zmq", "endpoint": "tcp://*:5557"}\' (data-parallel rank r: the port plus r)')
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve POST /sleep?level=1|2 (free the KV cache; level 2 the weights too), POST /wake_up "
                        "and GET /is_sleeping, for RL trainers that share the device with the engine; while "
                        "asleep requests get 503")


def _cache_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV-cache page; omitted: 16 on the CPU, 128 on NPUs and GPUs")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="size the KV cache from this fraction of the device's memory (on a cpu: of the RAM or "
                        "the cgroup's limit) less the weights, in (0, 1]; leave room for activations (None: room "
                        "for --max-model-len in every row)")
    g.add_argument("--kv-cache-memory-bytes", type=_human_int, default=None, metavar="BYTES",
                   help="the KV cache's size on each device, e.g. 4G (GiB) or 4g (10**9 bytes); overrides "
                        "--gpu-memory-utilization (on a cpu, vLLM's VLLM_CPU_KVCACHE_SPACE=<GiB> when this is omitted)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV-cache pages in all; overrides --kv-cache-memory-bytes and --gpu-memory-utilization "
                        "(None: from them, or room for --max-model-len in every row)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto: the KV cache in the model's dtype; fp8 / fp8_e4m3: in float8 (twice the tokens of "
                        "bf16 in the same memory; the torch attention backend only)")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory for prefix-cache pages evicted from the device: a later request "
                        "finding its prefix there gets it copied back instead of recomputed (None: off)")
    g.add_argument("--kv-offloading-backend", choices=("native",), default="native",
                   help="native: l3worker's own host tier (the only one)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes seen before")


def _parallel_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks over all nodes (None: one per --device-ids entry)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine-core processes, each with its share of --device-ids (on a cpu, of the cores), "
                        "behind the API server(s)")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="M",
                   help="data-parallel engines on this node (None: --data-parallel-size on the head, the ranks "
                        "from --data-parallel-start-rank on with --headless); the head waits for the others")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None, metavar="R",
                   help="--headless: the first data-parallel rank of this node's engines (ranks R .. R+M-1)")
    g.add_argument("--data-parallel-address", "-dpa", default=None, metavar="ADDR",
                   help="the head's address, where engines on other nodes connect (it listens there)")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None, metavar="P",
                   help="the head's port for engines on other nodes (tcp)")
    g.add_argument("--data-parallel-silence-timeout", type=float, default=SILENCE_S, metavar="S",
                   help="l3worker: a data-parallel node and its head that hear nothing from each other (pings "
                        "come every second) for this long take the other for gone; a lost node may register "
                        "again")
    g.add_argument("--data-parallel-routing", choices=ROUTINGS, default="cache_aware",
                   help="l3worker: which engine a request goes to: the one holding the longest prefix of its "
                        "prompt unless it is busier than the least loaded by half a batch (cache_aware), the "
                        "least loaded, or in turn")
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="MoE models over several --device-ids: split the experts across the ranks instead of "
                        "each expert's intermediate dimension")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes the tensor-parallel ranks span")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank; 0 is the head")
    g.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR",
                   help="the head's address: torch.distributed rendezvous and the followers' commands")
    g.add_argument("--master-port", type=int, default=None, metavar="P",
                   help="the rendezvous port on the head; follower node R takes its commands on "
                        "--master-port + R (needed with --nnodes > 1)")
    g.add_argument("--headless", action="store_true",
                   help="no HTTP: a tensor-parallel follower node (--node-rank >= 1), or with --data-parallel-* "
                        "flags this node's data-parallel engines, served by the head")


def _scheduler_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-num-seqs", type=int, default=16, metavar="N", help="batch rows: requests decoded at once")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: arrival order; priority: a request's `priority` (lower first, then arrival), and "
                        "a waiting request preempts a running one of lower priority")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"tokens per step: decoding rows plus prefill chunks (None: the larger of --max-num-seqs "
                        f"and {DEFAULT_BATCHED_TOKENS}); a step with decoding rows also carries only the prompt "
                        "tokens that fit in about one decode step's time, unless more prompts start than rows decode")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted: l3worker always splits long prompts into chunks of --max-num-batched-tokens")
    g.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per streamed chunk (the first and last excepted); N > 1 also reads N decode steps "
                        "per wake-up of the engine and keeps at least N + 1 steps in flight: fewer wake-ups per "
                        "token, at the price of tokens arriving N at a time")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help="l3worker: requests that may wait for a batch row; more are answered 503")


def _device_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--device", default="auto", choices=DEVICE_TYPES, help="where the model runs")
    g.add_argument("--device-ids", type=_device_ids, default=None, metavar="IDS",
                   help="comma-separated ids of this node's devices; several: tensor parallel (None: 0, or "
                        "0 .. N-1 for N ranks per node)")
    g.add_argument("--pipeline-depth", type=int, default=None, metavar="N",
                   help="step commands in flight (None: 4 on the cpu, 2 on an accelerator or with speculation)")
    g.add_argument("--cpu-layout", choices=CPU_LAYOUTS, default="auto",
                   help="cpu: every_core (a thread per core), spare_core (a core left for the server and the "
                        "sockets) or auto (by the model's size, checked by a start-up trial)")
    g.add_argument("--cpu-prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="cpu linear layers on oneDNN with weights prepacked at load (None: on where it runs)")
    g.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of the chip-children after one dies, raises or hangs, within --restart-window-s; "
                        "every request resumes (0: a failure stops the engine)")
    g.add_argument("--restart-window-s", type=float, default=600.0, metavar="S",
                   help="the window --max-restarts counts in")


def _frontend_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (vLLM listens on every address by default; give 0.0.0.0 for that)")
    g.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (any of several) on every path but /health, /ping, "
                        f"/version and /metrics (None: ${API_KEY_ENV} if set, else no key)")
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="the path prefix a proxy routes to this server (FastAPI's root_path)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: allowed origins, a JSON list")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: allow credentials")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: allowed methods, a JSON list")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: allowed headers, a JSON list")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS: the key file")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="the CA certificates file")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                   help="whether a client certificate is required (the ssl module's CERT_NONE 0, CERT_OPTIONAL 1, "
                        "CERT_REQUIRED 2)")
    g.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE",
                   help="a Jinja chat template: a file, or the template itself on one line (None: the "
                        "checkpoint's)")
    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of chat replies to a request with add_generation_prompt (true unless a request "
                        "sets it false; then the last message's role)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat replies' <think> block into reasoning_content / reasoning")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the format of the model's tool calls (hermes: <tool_call>{json}</tool_call>)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls into tool_calls when a request's tool_choice is auto (needs "
                        "--tool-call-parser)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' unless a request sets return_tokens_as_token_ids")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    g.add_argument("--enable-weight-updates", action="store_true",
                   help="l3worker: serve SGLang's POST /update_weights_from_disk (a checkpoint of the same "
                        "architecture, loaded in place, with a weight_version that /v1/models and every response "
                        "report), POST /pause_generation (mode abort or keep), POST /continue_generation and "
                        "POST /reset_prefix_cache, for RL trainers")
    g.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="API server processes sharing the listening socket, each with its own connection to the "
                        "engine-core process")
    g.add_argument("--inline-engine", action="store_true",
                   help="l3worker: run the engine in the API server's process, stepped by its event loop, instead "
                        "of in an engine-core process (one API server and one engine, on Linux on x86): a token wakes "
                        "one process instead of three")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="accepted: uvicorn's access log is always off (the request log line replaces it)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="uvicorn's log level")


def _logging_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's prompt token ids and sampling parameters as it arrives")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request (status, time, tokens)")
    g.add_argument("--disable-log-stats", action=argparse.BooleanOptionalAction, default=False,
                   help="no throughput line every 10 s while requests run")


def api_key_default() -> str | None:
    return os.environ.get(API_KEY_ENV) or None
