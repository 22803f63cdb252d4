"""The worker's scalar arguments, checked before any child starts: each refusal is a TypeError or
ValueError naming the argument and its limit."""
from __future__ import annotations

from chip_child.config import CPU_LAYOUTS
from l3worker.params import DEFAULT_BATCHED_TOKENS

MAX_SPIN_S = 0.1  # a spinning parent checks nothing else, so failures surface at most this late


SCHEDULING_POLICIES = ("fcfs", "priority")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_kv_cache_dtype(cache_dtype: object, backend_name: str) -> None:
    """An fp8 cache with a backend that cannot read one, refused before any child starts."""
    if cache_dtype is not None and backend_name not in ("torch", "cpu", "triton"):
        raise ValueError(f"kv_cache_dtype: an fp8 cache is read by the torch, cpu and triton attention backends only so "
                         f"far, and this device's is {backend_name!r} (attention_backend='torch' to use it)")


def check_speculation_switches(speculative: bool, decode_graphs: bool | None, overlap_steps: bool | None) -> None:
    if speculative and decode_graphs:
        raise ValueError("speculative_config cannot be combined with decode_graphs=True: the verify step runs "
                         "eagerly (leave decode_graphs None)")
    if speculative and overlap_steps:
        raise ValueError("speculative_config cannot be combined with overlap_steps=True: a verify step's row "
                         "lengths come from the step before it (leave overlap_steps None)")


def default_pipeline_depth(kind: str, speculative: bool) -> int:
    """Step commands in flight when the caller names no pipeline_depth: 4 on the CPU, where the
    child's threads fill the cores and the parent, woken by the doorbell, may wait a scheduler
    slice for one (with 2 in flight the child then waits for its next command: at one client on the
    27M model the served TPOT was 15% higher, docs/performance/serving.md); 2 elsewhere, and with
    speculation, whose steps run in order."""
    return 4 if kind == "cpu" and not speculative else 2


def positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_limits(*, max_batch_size: int, max_seq_len: int, page_size: int, pipeline_depth: int,
                 max_num_batched_tokens: int | None, enable_prefix_caching: bool, num_pages: int | None,
                 num_threads: int | None, cpu_layout: str, pin_cores: bool, spin_wait_s: float,
                 step_timeout_s: float | None, startup_timeout_s: float | None,
                 max_waiting_requests: int | None, stream_interval: int) -> int:
    """Checks the batch, page, thread and timeout limits; returns max_num_batched_tokens (its
    default filled in)."""
    positive_int("max_batch_size", max_batch_size)
    positive_int("max_seq_len", max_seq_len, 2)
    positive_int("page_size", page_size)
    positive_int("pipeline_depth", pipeline_depth)
    positive_int("stream_interval", stream_interval)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(DEFAULT_BATCHED_TOKENS, max_batch_size)
    positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if max_num_batched_tokens < max_batch_size:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_batch_size="
                         f"{max_batch_size}: every decoding row takes one token of a step")
    if not isinstance(enable_prefix_caching, bool):
        raise TypeError(f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}")
    if num_pages is not None:
        positive_int("num_pages", num_pages)
    if num_threads is not None:
        positive_int("num_threads", num_threads)
    if cpu_layout not in CPU_LAYOUTS:
        raise ValueError(f"cpu_layout must be one of {CPU_LAYOUTS}, got {cpu_layout!r}")
    if num_threads is not None and cpu_layout != "auto":
        raise ValueError(f"cpu_layout={cpu_layout!r} and num_threads={num_threads} both set the cpu threads: "
                         "give one")
    if not isinstance(pin_cores, bool):
        raise TypeError(f"pin_cores must be a bool, got {type(pin_cores).__name__}")
    if not 0 <= spin_wait_s <= MAX_SPIN_S:
        raise ValueError(f"spin_wait_s must be in [0, {MAX_SPIN_S}] seconds, got {spin_wait_s}")
    for name, value in (("step_timeout_s", step_timeout_s), ("startup_timeout_s", startup_timeout_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 seconds or None, got {value}")
    if max_waiting_requests is not None:
        positive_int("max_waiting_requests", max_waiting_requests)
    return max_num_batched_tokens
