"""Ascend NPU attention through torch_npu's fused paged ops; this module only plumbs.

Cache layout: [layers, 2 (k, v), pages, page_size, kv_heads, head_dim], the layout of the triton
backend. Per layer the K (V) cache is viewed two ways, both without a copy:

- [pages, page_size, kv_heads, head_dim] for the K/V write,
  ``torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)``
  (on releases without it, ``torch_npu._npu_reshape_and_cache(key=, value=, key_cache=,
  value_cache=, slot_indices=)`` with int32 slots); key/value [T, kv_heads, head_dim], contiguous;
- [pages, page_size, kv_heads * head_dim] for ``torch_npu.npu_fused_infer_attention_score``
  with ``block_table`` (int32 [N, W]) and ``block_size=page_size``:
  - a pure decode step (one token per sequence): ``input_layout="BSH"``, query [N, 1, heads *
    head_dim], ``actual_seq_lengths_kv`` = each sequence's length;
  - anything else: ``input_layout="TND"``, query [T, heads, head_dim],
    ``actual_seq_lengths`` = cumulative ends of the sequences' new tokens (query_start_loc[1:]),
    ``actual_seq_lengths_kv`` = each sequence's length (per sequence: with a block table the
    keys are not packed), ``sparse_mode=3`` (causal aligned to the bottom right: token i of a
    chunk of q_len sees keys up to i + seq_len - q_len) with the 2048 x 2048 upper-triangular
    bool mask that mode takes.

Constraints checked at construction (ValueError naming the field): dtype float16 or bfloat16;
page_size a multiple of 16, and for the fused prefill path a multiple of 128 up to 512 (a
`decode_only` backend accepts any multiple of 16); head_dim a multiple of 16; at most 64 query
heads per kv head; kv_heads * head_dim below 65536.

The op takes the lengths as host lists, so each step hands them over from
`AttentionMetadata.query_lens_host` / `seq_lens_host` (read from the device tensors when they
are missing, which syncs). Releases with torchair's device-tensor lengths can take them from
the device instead; the decode call is otherwise graph-friendly (fixed shapes per batch size).
"""
from __future__ import annotations

import torch

from chip_child.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec, StepPlan

DTYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048


class NpuAttention(AttentionBackend):
    name = "npu"
    cache_layout = "layer, k|v, page, offset, kv_head, head_dim"
    decode_capturable = False  # the vendor op takes the lengths as host lists: a graph would freeze them

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "npu", *, decode_only: bool = False):
        super().__init__(spec, device)
        if not decode_only and (spec.page_size % 128 or spec.page_size > 512):
            raise ValueError(f"page_size={spec.page_size}: torch_npu's fused paged attention over prefill chunks "
                             "needs a multiple of 128 up to 512 (decode_only=True accepts multiples of 16)")
        self.decode_only = decode_only
        import torch_npu

        self._npu = torch_npu
        self._scatter = getattr(torch_npu, "npu_scatter_pa_kv_cache", None)
        self._mask: torch.Tensor | None = None

    @classmethod
    def validate(cls, spec: AttentionSpec) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype: torch_npu's fused attention takes {DTYPES}, got {spec.dtype}")
        if spec.kv_dtype != spec.dtype:
            raise ValueError(f"kv_cache_dtype: an {spec.kv_dtype} cache is read by the torch and triton attention "
                             "backends only so far")
        if spec.page_size % 16:
            raise ValueError(f"page_size={spec.page_size}: torch_npu's paged attention needs a multiple of 16")
        if spec.head_dim % 16:
            raise ValueError(f"head_dim={spec.head_dim}: torch_npu's fused attention needs a multiple of 16")
        if spec.group > 64:
            raise ValueError(f"num_heads / num_kv_heads = {spec.group}: torch_npu allows at most 64")
        if spec.num_kv_heads * spec.head_dim >= 65536:
            raise ValueError(f"num_kv_heads * head_dim = {spec.num_kv_heads * spec.head_dim}: must stay below 65536")

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, 2, s.num_pages, s.page_size, s.num_kv_heads, s.head_dim)

    def _bind_views(self) -> None:
        s = self.spec
        layers = range(s.num_layers)
        self._k4 = [self.kv_cache[i, 0] for i in layers]  # [pages, page, kvh, hd]
        self._v4 = [self.kv_cache[i, 1] for i in layers]
        hidden = s.num_kv_heads * s.head_dim
        self._k3 = [t.view(s.num_pages, s.page_size, hidden) for t in self._k4]  # [pages, page, kvh * hd]
        self._v3 = [t.view(s.num_pages, s.page_size, hidden) for t in self._v4]
        if not self.decode_only:
            ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=self.kv_cache.device)
            self._mask = torch.triu(ones, diagonal=1)  # True: masked

    # ---- writes --------------------------------------------------------------------------
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._check_bound()
        k, v = k.contiguous(), v.contiguous()
        if self._scatter is not None:
            self._scatter(k, v, self._k4[layer], self._v4[layer], slot_mapping.contiguous())
        else:
            slots = slot_mapping if slot_mapping.dtype == torch.int32 else slot_mapping.to(torch.int32)
            self._npu._npu_reshape_and_cache(key=k, value=v, key_cache=self._k4[layer], value_cache=self._v4[layer],
                                             slot_indices=slots.contiguous())

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_bound()
        s = self.spec
        idx = slots.to(self.device, torch.int64)
        return (self._k4[layer].view(-1, s.num_kv_heads, s.head_dim).index_select(0, idx),
                self._v4[layer].view(-1, s.num_kv_heads, s.head_dim).index_select(0, idx))

    # ---- per step --------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> StepPlan:
        self._check_bound()
        self._check_capacity(meta)
        q_lens, s_lens = meta.host_lengths()
        table = meta.block_table if meta.block_table.dtype == torch.int32 else meta.block_table.to(torch.int32)
        step = StepPlan(meta)
        step.extra.update(block_table=table.contiguous(), seq_lens=s_lens)
        decode = meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs and all(q == 1 for q in q_lens)
        if decode:
            step.extra["layout"] = "BSH"
            return step
        if self.decode_only:
            raise ValueError(f"page_size={self.spec.page_size}: this npu backend is decode_only and cannot run "
                             "prefill chunks")
        ends, total = [], 0
        for q in q_lens:
            total += q
            ends.append(total)
        step.extra.update(layout="TND", query_ends=ends, total=total)
        return step

    def attend(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        self._check_bound()
        s, x = self.spec, step.extra
        t = q.shape[0]
        common = dict(num_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, scale=s.softmax_scale,
                      block_table=x["block_table"], block_size=s.page_size, actual_seq_lengths_kv=x["seq_lens"])
        if x["layout"] == "BSH":
            query = q.reshape(t, 1, s.num_heads * s.head_dim).contiguous()
            o, _ = self._npu.npu_fused_infer_attention_score(query, self._k3[layer], self._v3[layer],
                                                             input_layout="BSH", **common)
            o = o.view(t, s.num_heads, s.head_dim)
        else:
            total = x["total"]
            query = q[:total].contiguous()
            o, _ = self._npu.npu_fused_infer_attention_score(query, self._k3[layer], self._v3[layer],
                                                             input_layout="TND", actual_seq_lengths=x["query_ends"],
                                                             sparse_mode=3, atten_mask=self._mask, **common)
            if total < t:  # padding tokens: unspecified rows, kept finite
                o = torch.cat([o, o.new_zeros(t - total, s.num_heads, s.head_dim)])
        if out is None:
            return o
        out = self._out(q, out)
        out.copy_(o)
        return out
