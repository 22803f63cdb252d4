"""vLLM's `LLM(...)` engine arguments as DistributedWorker's: renamed where l3worker has the same
setting, accepted where the value changes nothing here, refused by name otherwise (never ignored).
DistributedWorker's own keywords (device, device_ids, pipeline_depth, ...) pass through as they are."""
from __future__ import annotations

import inspect
from typing import Any

from l3worker.worker.distributed_worker import DistributedWorker

# vLLM's name -> DistributedWorker's, same meaning and units.
RENAMED = {
    "tensor_parallel_size": "tensor_parallel_size",
    "quantization": "quantization",
    "max_model_len": "max_seq_len",
    "max_num_seqs": "max_batch_size",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "num_gpu_blocks_override": "num_pages",
    "block_size": "page_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_expert_parallel": "enable_expert_parallel",
    "speculative_config": "speculative_config",
    "enable_sleep_mode": "enable_sleep_mode",
    "kv_cache_dtype": "kv_cache_dtype",
}
# vLLM arguments accepted at these values only: each either is l3worker's behaviour already or
# tunes something l3worker does not have, so the value cannot change what comes out.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tokenizer_mode": ("auto", "hf"),
    "skip_tokenizer_init": (False,),
    "trust_remote_code": (False, True),  # l3worker never runs code from a checkpoint: nothing to allow
    "swap_space": (4, 0),  # a preempted row is recomputed, never swapped out
    "cpu_offload_gb": (0,),
    "disable_custom_all_reduce": (False, True),
    "disable_async_output_proc": (False, True),
    "disable_log_stats": (True, False),
    "max_seq_len_to_capture": (8192,),
    "compilation_config": (None,),  # enforce_eager is the one graph switch
    "hf_overrides": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "distributed_executor_backend": (None, "mp"),
    "load_format": ("auto", "safetensors"),
    "enable_chunked_prefill": (None, True),  # long prompts are always prefilled in chunks
    "enable_prompt_embeds": (False,),
    "logprobs_mode": ("processed_logprobs",),  # the sampled distribution's (see SamplingParams)
    "use_tqdm_on_load": (True, False),
    "runner": ("auto", "generate"),
    "convert": ("auto", "none"),
    "task": ("auto", "generate"),
    "hf_token": (None,),  # the Hub client reads HF_TOKEN
}
# vLLM's spellings of dtypes DistributedWorker names otherwise.
_DTYPES = {"float": "float32"}
# Set by LLM itself, not passed through.
_OWN = {"self", "model_dir", "revision", "download_dir"}


def worker_kwargs(given: dict[str, Any]) -> dict[str, Any]:
    """DistributedWorker's keyword arguments for LLM's engine arguments `given`."""
    worker_names = set(inspect.signature(DistributedWorker.__init__).parameters) - _OWN
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # worker name -> the LLM argument that set it
    for name, value in given.items():
        if name in NEUTRAL:
            if not any(value is v or (type(value) is type(v) and value == v) for v in NEUTRAL[name]):
                raise ValueError(f"{name}={value!r} is not supported by l3worker (accepted: "
                                 f"{' or '.join(map(repr, NEUTRAL[name]))})")
            continue
        if name in RENAMED:
            if value is None:  # vLLM's "its default": DistributedWorker's then
                continue
            target = RENAMED[name]
        elif name == "enforce_eager":  # vLLM's switch for CUDA graphs; l3worker captures decode steps
            if not isinstance(value, bool):
                raise TypeError(f"enforce_eager must be a bool, got {type(value).__name__}")
            target, value = "decode_graphs", (False if value else None)
        elif name in worker_names:  # l3worker's own settings, under DistributedWorker's names
            target = name
        else:
            raise ValueError(f"{name} is not supported by l3worker's LLM")
        if target in out:
            raise ValueError(f"{source[target]} and {name} both set {target}: give one")
        out[target], source[target] = (_dtype(value) if name == "dtype" else value), name
    return out


def _dtype(value: Any) -> Any:
    """vLLM takes a torch.dtype or a name; DistributedWorker takes names."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    return _DTYPES.get(value, value) if isinstance(value, str) else value
