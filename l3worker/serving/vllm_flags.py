"""`vllm serve`'s flag names, so that one l3worker does not implement is refused by name
(`l3worker does not support --swap-space`) instead of with argparse's generic "unrecognized
arguments", and vLLM's spellings of flags are accepted (`--max_model_len` for `--max-model-len`).

The names are vLLM's (engine, frontend and serve arguments, current and recently removed ones);
the serve parser subtracts the ones it implements, so a flag added there stops being refused here.
"""
from __future__ import annotations

from collections.abc import Iterable

VLLM_SERVE_FLAGS: frozenset[str] = frozenset("""
--model --runner --convert --task --tokenizer --tokenizer-mode --trust-remote-code --dtype --seed
--hf-config-path --allowed-local-media-path --allowed-media-domains --revision --code-revision --rope-scaling
--rope-theta --tokenizer-revision --max-model-len --quantization -q --enforce-eager --max-seq-len-to-capture
--max-logprobs --logprobs-mode --disable-sliding-window --disable-cascade-attn --skip-tokenizer-init
--enable-prompt-embeds --served-model-name --config-format --hf-token --hf-overrides --pooler-config
--override-pooler-config --logits-processor-pattern --generation-config --override-generation-config
--enable-sleep-mode --model-impl --override-attention-dtype --logits-processors --io-processor-plugin
--limit-mm-per-prompt --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb --mm-processor-cache-type
--mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode --mm-encoder-attn-backend --interleave-mm-strings
--skip-mm-profiling --video-pruning-rate --disable-mm-preprocessor-cache
--load-format --download-dir --safetensors-load-strategy --model-loader-extra-config --ignore-patterns
--use-tqdm-on-load --pt-load-map-location
--guided-decoding-backend --guided-decoding-disable-fallback --guided-decoding-disable-any-whitespace
--guided-decoding-disable-additional-properties --structured-outputs-config --reasoning-parser
--reasoning-parser-plugin
--distributed-executor-backend --pipeline-parallel-size -pp --tensor-parallel-size -tp
--decode-context-parallel-size -dcp --data-parallel-size -dp --data-parallel-rank -dpn --data-parallel-start-rank
-dpr --data-parallel-size-local -dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp
--data-parallel-backend -dpb --data-parallel-hybrid-lb --data-parallel-external-lb --enable-expert-parallel -ep
--enable-dbo --dbo-decode-token-threshold --dbo-prefill-token-threshold --enable-eplb --eplb-config
--expert-placement-strategy --num-redundant-experts --eplb-window-size --eplb-step-interval
--eplb-log-balancedness --max-parallel-loading-workers --ray-workers-use-nsight --disable-custom-all-reduce
--worker-cls --worker-extension-cls --enable-multimodal-encoder-data-parallel --nnodes --node-rank
--master-addr --master-port --all2all-backend
--block-size --gpu-memory-utilization --kv-cache-memory --kv-cache-memory-bytes --swap-space --kv-cache-dtype
--num-gpu-blocks-override --enable-prefix-caching --prefix-caching-hash-algo --cpu-offload-gb
--calculate-kv-scales --kv-sharing-fast-prefill --mamba-cache-dtype --mamba-ssm-cache-dtype
--kv-offloading-size --kv-offloading-backend
--enable-lora --enable-lora-bias --max-loras --max-lora-rank --lora-extra-vocab-size --lora-dtype
--max-cpu-loras --fully-sharded-loras --default-mm-loras --lora-modules --qlora-adapter-name-or-path
--enable-prompt-adapter --max-prompt-adapters --max-prompt-adapter-token
--show-hidden-metrics-for-version --otlp-traces-endpoint --collect-detailed-traces
--max-num-batched-tokens --max-num-seqs --max-num-partial-prefills --max-long-partial-prefills
--long-prefill-token-threshold --num-lookahead-slots --scheduling-policy --enable-chunked-prefill
--disable-chunked-mm-input --scheduler-cls --disable-hybrid-kv-cache-manager --async-scheduling
--cuda-graph-sizes --stream-interval --preemption-mode --use-v2-block-manager --num-scheduler-steps
--multi-step-stream-outputs --scheduler-delay-factor
--speculative-config --speculative-model --num-speculative-tokens --kv-transfer-config --kv-events-config
--compilation-config -O --additional-config --disable-async-output-proc --override-neuron-config
--tokenizer-pool-size --tokenizer-pool-type --tokenizer-pool-extra-config
--enable-log-requests --disable-log-requests --disable-log-stats --aggregate-engine-logging
--host --port --uds --uvicorn-log-level --disable-uvicorn-access-log --disable-access-log-for-endpoints
--allow-credentials --allowed-origins --allowed-methods --allowed-headers --api-key --chat-template
--chat-template-content-format --trust-request-chat-template --default-chat-template-kwargs --response-role
--ssl-keyfile --ssl-certfile --ssl-ca-certs --enable-ssl-refresh --ssl-cert-reqs --ssl-ciphers --root-path
--middleware --return-tokens-as-token-ids --disable-frontend-multiprocessing --enable-request-id-headers
--enable-auto-tool-choice --exclude-tools-when-tool-choice-none --tool-call-parser --tool-parser-plugin
--tool-server --log-config-file --max-log-len --disable-fastapi-docs --enable-prompt-tokens-details
--enable-server-load-tracking --enable-force-include-usage --enable-tokenizer-info-endpoint
--enable-log-outputs --h11-max-incomplete-event-size --h11-max-header-count --log-error-stack
--headless --api-server-count -asc --config --grpc
""".split())


def vllm_spelling(arg: str) -> str:
    """vLLM's parser takes `--max_model_len` for `--max-model-len`: the flag part of `arg` with
    dashes for underscores (a value after `=` is left as it is)."""
    if not arg.startswith("--"):
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value


def unsupported_flag(args: Iterable[str], supported: set[str]) -> str | None:
    """The first of `args` that names a vLLM serve flag not in `supported` (or its --no- form), as
    written before any `=value`; None when there is none. Stops at a lone `--`."""
    for arg in args:
        if arg == "--":
            return None
        if not arg.startswith("-") or arg.startswith("---"):
            continue
        flag = arg.partition("=")[0]
        if flag.startswith("-O") and len(flag) > 2 and not flag.startswith("--"):  # -O3: vLLM's -O with a value
            flag = "-O"
        if flag in supported:
            continue
        base = "--" + flag[5:] if flag.startswith("--no-") else flag  # vLLM's booleans take --no-X too
        if base in VLLM_SERVE_FLAGS:
            return flag
    return None
