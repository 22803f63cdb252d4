"""Our own Triton kernels for paged attention (chip_child.attention.triton_kernels).

Cache layout: [layers, 2 (k, v), pages, page_size, kv_heads, head_dim], page-major with one
token's K (or V) for every kv head in one contiguous row:

- the K/V write is one contiguous row per token (kv_heads * head_dim elements), coalesced;
- a kernel tile of keys for one kv head reads head_dim-contiguous rows, one per position,
  wherever the block table puts their pages, so nothing is gathered and a tile may span pages;
- it is the layout torch_npu's paged ops use ([pages, page_size, kv_heads * head_dim]), so the
  triton and npu backends share one cache description.

A step is one launch of the attention kernel over (sequences, query blocks, kv heads[, splits])
and, when the keys are split (flash-decoding), one launch of the merge kernel. Grid sizes and the
split count come from host ints only (T, N, max_query_len, max_seq_len); lengths, starts and
pages are read on the device, so a captured CUDA graph replays any batch within its bounds.
"""
from __future__ import annotations

import math

import torch

from chip_child.attention.base import (AttentionBackend, AttentionMetadata, AttentionSpec, StepPlan, WorkspaceShapes,
                                       to_fp8)

LOG2E = 1.4426950408889634


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHARED_MEMORY_BUDGET = 160 * 1024  # bytes of pipelined K/V tiles per program, below every recent GPU's limit


class TritonAttention(AttentionBackend):
    name = "triton"
    cache_layout = "layer, k|v, page, offset, kv_head, head_dim"

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cuda", *, max_kv_splits: int = 8,
                 keys_per_split: int = 512, num_kv_splits: int | None = None, block_n: int | None = None,
                 split_max_query_len: int = 16, num_warps: int = 4):
        """Split-KV is used when a step has at most `spec.max_seqs` tokens, no sequence brings
        more than `split_max_query_len` of them, and the longest context exceeds
        `keys_per_split`: then ceil(max_seq_len / keys_per_split) splits, at most
        `max_kv_splits` (and on cuda no more than fill the SMs twice). `num_kv_splits` forces
        a count (1 turns splitting off); `block_n` forces the key tile."""
        super().__init__(spec, device)
        from chip_child.attention import triton_kernels

        self._kernels = triton_kernels
        if num_kv_splits is not None and not 1 <= num_kv_splits <= max_kv_splits:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be within 1..max_kv_splits={max_kv_splits}")
        self.max_kv_splits = max_kv_splits
        self.keys_per_split = keys_per_split
        self.num_kv_splits = num_kv_splits
        self.block_n = block_n
        self.split_max_query_len = split_max_query_len
        self.num_warps = num_warps
        self._block_d = max(16, triton_kernels.next_power_of_2(spec.head_dim))
        self._block_c = triton_kernels.next_power_of_2(spec.num_kv_heads * spec.head_dim)
        self._sm_count = None
        # An fp8 cache is bound as uint8 views: the write kernel copies bytes rounded by `to_fp8`,
        # the attention kernel decodes them (KV_FP8).
        self._fp8 = spec.kv_dtype != spec.dtype
        self._interpreted = self.device.type == "cpu"  # Triton's interpreter (TRITON_INTERPRET=1)
        # Programs of the write and merge kernels: small on a GPU; under the interpreter, whose
        # cost is per program, as large as the work allows.
        if self._interpreted:
            self._write_block_t = 64
            self._merge_block_h = triton_kernels.next_power_of_2(spec.num_heads)
        else:
            self._write_block_t = max(1, min(16, 4096 // self._block_c))
            self._merge_block_h = 1
        if self.device.type == "cuda":
            self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count

    @classmethod
    def validate(cls, spec: AttentionSpec) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype: the triton backend supports {DTYPES}, got {spec.dtype}")
        if spec.kv_dtype not in (spec.dtype, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype: the triton backend reads a cache of the model's dtype or float8_e4m3fn, "
                             f"got {spec.kv_dtype}")

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, 2, s.num_pages, s.page_size, s.num_kv_heads, s.head_dim)

    @property
    def workspace_shapes(self) -> WorkspaceShapes:
        s = self.spec
        if self.max_kv_splits <= 1:
            return {}
        return {"split_out": ((s.max_seqs, s.num_heads, self.max_kv_splits, s.head_dim), torch.float32),
                "split_lse": ((s.max_seqs, s.num_heads, self.max_kv_splits), torch.float32)}

    def _bind_views(self) -> None:
        cache = self.kv_cache.view(torch.uint8) if self._fp8 else self.kv_cache
        self._k = [cache[i, 0] for i in range(self.spec.num_layers)]  # [pages, page, kvh, hd]
        self._v = [cache[i, 1] for i in range(self.spec.num_layers)]

    # ---- writes --------------------------------------------------------------------------
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._check_bound()
        t = k.shape[0]
        if t == 0:
            return
        if self._fp8:
            k, v = to_fp8(k).view(torch.uint8), to_fp8(v).view(torch.uint8)
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
        s = self.spec
        block_t = min(self._write_block_t, self._kernels.next_power_of_2(t))
        self._kernels.write_kv_kernel[(triton_cdiv(t, block_t),)](
            k, v, self._k[layer], self._v[layer], slot_mapping, t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=s.num_kv_heads, HEAD_DIM=s.head_dim, BLOCK_T=block_t, BLOCK_C=self._block_c,
            num_warps=4)

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_bound()
        s = self.spec
        idx = slots.to(self.device, torch.int64)
        k, v = (x[layer].view(-1, s.num_kv_heads, s.head_dim).index_select(0, idx) for x in (self._k, self._v))
        if self._fp8:
            return k.view(s.kv_dtype).to(s.dtype), v.view(s.kv_dtype).to(s.dtype)
        return k, v

    # ---- per step --------------------------------------------------------------------------
    def num_splits(self, meta: AttentionMetadata) -> int:
        """How many ranges each sequence's keys are cut into this step (host ints only)."""
        s = self.spec
        if (self.max_kv_splits <= 1 or meta.num_tokens > s.max_seqs
                or meta.max_query_len > self.split_max_query_len):
            return 1
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        splits = min(self.max_kv_splits, math.ceil(meta.max_seq_len / self.keys_per_split))
        if self._sm_count is not None:
            programs = max(1, meta.num_seqs * s.num_kv_heads)
            splits = min(splits, max(1, math.ceil(2 * self._sm_count / programs)))
        return max(1, splits)

    def plan(self, meta: AttentionMetadata) -> StepPlan:
        self._check_bound()
        self._check_capacity(meta)
        s = self.spec
        g = s.group
        max_q = max(1, meta.max_query_len)
        block_m = min(128, max(16, self._kernels.next_power_of_2(max_q * g)))
        block_m = max(block_m, self._kernels.next_power_of_2(g))
        block_q = block_m // g
        block_n = self.block_n or (64 if block_m <= 64 else 32)
        splits = self.num_splits(meta)
        grid = (meta.num_seqs, math.ceil(max_q / block_q), s.num_kv_heads * splits)
        qsl = meta.query_start_loc if meta.query_start_loc.dtype == torch.int32 else meta.query_start_loc.int()
        lens = meta.seq_lens if meta.seq_lens.dtype == torch.int32 else meta.seq_lens.int()
        table = meta.block_table if meta.block_table.dtype == torch.int32 else meta.block_table.int()
        step = StepPlan(meta)
        # A 128 x 128 fp32 accumulator needs more than four warps' registers.
        warps = self.num_warps if block_m * self._block_d < 128 * 128 else max(self.num_warps, 8)
        # Software pipelining keeps num_stages K and V tiles in shared memory at once: fewer stages
        # for large tiles (a 128-key fp32 tile at head_dim 128 needs 128 KiB a stage; an H100 has 227).
        stage_bytes = 2 * block_n * self._block_d * s.dtype.itemsize
        stages = next((n for n in (3, 2) if n * stage_bytes <= SHARED_MEMORY_BUDGET), 1)
        step.extra.update(grid=grid, block_m=block_m, block_q=block_q, block_n=block_n, splits=splits,
                          query_start_loc=qsl, seq_lens=lens, block_table=table, num_warps=warps, num_stages=stages)
        return step

    def attend(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        self._check_bound()
        out = self._out(q, out)
        x, s = step.extra, self.spec
        if x["grid"][0] == 0:
            return out
        if q.stride(-1) != 1:
            q = q.contiguous()
        splits = x["splits"]
        if splits > 1:
            part_out, part_lse = self.workspace["split_out"], self.workspace["split_lse"]
        else:
            part_out, part_lse = out, out  # not read
        table = x["block_table"]
        self._kernels.paged_attention_kernel[x["grid"]](
            q, self._k[layer], self._v[layer], out, part_out, part_lse,
            x["query_start_loc"], x["seq_lens"], table,
            s.softmax_scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2) if splits > 1 else 0,
            part_lse.stride(0), part_lse.stride(1),
            NUM_KV_HEADS=s.num_kv_heads, GROUP=s.group, HEAD_DIM=s.head_dim, BLOCK_D=self._block_d,
            PAGE_SIZE=s.page_size, BLOCK_M=x["block_m"], BLOCK_Q=x["block_q"], BLOCK_N=x["block_n"],
            NUM_SPLITS=splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            DOT_FP32=self._interpreted and q.dtype == torch.bfloat16, KV_FP8=self._fp8,
            num_warps=x["num_warps"], num_stages=x["num_stages"])
        if splits > 1:
            t = step.meta.num_tokens
            block_h = self._merge_block_h
            self._kernels.merge_splits_kernel[(t, triton_cdiv(s.num_heads, block_h))](
                part_out, part_lse, out, s.num_heads, part_out.stride(0), part_out.stride(1), part_out.stride(2),
                part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
                NUM_SPLITS=splits, BLOCK_S=self._kernels.next_power_of_2(splits), BLOCK_H=block_h,
                HEAD_DIM=s.head_dim, BLOCK_D=self._block_d, num_warps=self.num_warps)
        return out
