"""What a chip runtime is built with: its config and the limits commands are checked against.

Torch-free: the parent builds a RuntimeConfig and reads its limits without loading the child's
runtime (a test keeps this module and chip_child.protocol off torch).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

COPY_POLICIES = ("dirty", "always")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3 with a per-tensor scale of 1
DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
CPU_LAYOUTS = ("auto", "every_core", "spare_core")  # chip_child.device.default_cpu_threads says what each is


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_blocks_per_row: int
    num_pages: int
    max_seq_len: int
    max_prefill_tokens: int
    page_size: int
    vocab_size: int = 0  # 0: unknown, token ids are only checked to be non-negative
    host_pages: int = 0  # slots of the host tier of the prefix cache (0: none)
    max_loras: int = 0  # LoRA adapter slots (0: none)


@dataclass
class RuntimeConfig:
    model_dir: str
    device: str = "auto"
    device_id: int = 0
    dtype: str = "auto"
    max_batch_size: int = 16
    max_seq_len: int = 4096
    page_size: int = 128
    num_pages: int | None = None  # None: every row can reach max_seq_len
    max_prefill_tokens: int | None = None  # chunk tokens per step; None: max(max_seq_len, 2048)
    copy_policy: str = "dirty"
    attention_backend: str | None = None  # None: the device's default (see chip_child.attention)
    decode_graphs: bool | None = None  # None: on for cuda and npu where the backend allows (chip_child.step.graphs)
    fused_kernels: bool | None = None  # None: on for cuda where triton imports (chip_child.models.fused)
    cpu_prepack: bool | None = None  # None: on for the cpu where oneDNN runs the dtype (chip_child.models.prepack)
    num_threads: int | None = None  # cpu intra-op threads; None: see default_cpu_threads
    quantization: str | None = None  # a method applied at load ("fp8"); None: as the checkpoint is stored
    enable_expert_parallel: bool = False  # MoE experts split whole across the tensor-parallel ranks
    tp_rank: int = 0
    tp_size: int = 1
    dist_init: str | None = None  # torch.distributed init_method when tp_size > 1
    speculative: dict | None = None  # chip_child.spec.config.SpeculativeConfig's fields; None: off
    enable_sleep_mode: bool = False  # weights in storage sleep can free in place (chip_child.step.sleep)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8 pages (torch backend)
    host_kv_pages: int = 0  # the prefix cache's host tier, in pages (--kv-offloading-size); 0: none
    max_loras: int = 0  # LoRA adapter slots, each of rank up to max_lora_rank (chip_child.models.lora); 0: none
    max_lora_rank: int = 16

    @property
    def max_blocks_per_row(self) -> int:
        return math.ceil(self.max_seq_len / self.page_size)

    @property
    def total_pages(self) -> int:
        """Pages in the cache, counting page 0, the scratch page idle rows write to."""
        if self.num_pages is not None:
            return self.num_pages + 1
        return self.max_batch_size * self.max_blocks_per_row + 1

    @property
    def reachable_positions(self) -> int:
        """Positions one row can take: below max_seq_len, and within the pool's pages."""
        return min(self.max_seq_len - 1, (self.total_pages - 1) * self.page_size)

    @property
    def prefill_capacity(self) -> int:
        return self.max_prefill_tokens or max(self.max_seq_len, 2048)

    def limits(self) -> Limits:
        return Limits(self.max_batch_size, self.max_blocks_per_row, self.total_pages,
                      self.max_seq_len, self.prefill_capacity, self.page_size, host_pages=self.host_kv_pages,
                      max_loras=self.max_loras)


def config_fields(value: object, cls: type, name: str) -> dict:
    """The keys of a dataclass-shaped config given as a dict or a JSON object's text, checked:
    ValueError for bad JSON, something other than an object, or a key `cls` does not have."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(known)}")
    return value
