"""The cpu backend: the torch backend, with decode rows on a kernel of our own
(chip_child.cpu_kernels.decode_attention) that reads each row's keys and values in place from
the paged cache: no per-layer gather into a workspace, no dense mirror to keep, no strided
matmul copies. A pure decode step is one kernel call per layer; in a step that also carries
prompt chunks, the decode rows take the kernel and the chunks TorchAttention's SDPA paths.

The kernel runs on AVX-512, or on AVX2 where the cpu has no AVX-512. Where neither can run (no
AVX2, no compiler, a failed check, a dtype or head shape it does not take,
`L3WORKER_REFERENCE_KERNELS=cpu_decode_attention`), decode steps take the
torch backend's own paths, and the reason is printed once. What it is worth end to end:
`python scripts/bench_cpu_kernels.py` (docs/performance/cpu.md)."""
from __future__ import annotations

import sys

import torch

from chip_child.attention.base import AttentionMetadata, AttentionSpec, StepPlan
from chip_child.attention.torch_backend import TorchAttention
from chip_child.cpu_kernels import decode_attention


class CpuAttention(TorchAttention):
    name = "cpu"
    decode_capturable = False  # the kernel reads lengths and pages through host pointers

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cpu", decode_mirror: bool | None = None,
                 **options):
        lib = decode_attention.library()
        fits = lib is not None and spec.kv_dtype == spec.dtype and decode_attention.supports(
            lib, spec.dtype, spec.head_dim)
        if lib is not None and not fits:
            print(f"chip-child: decode attention runs on torch ops: the cpu_decode_attention kernel does not take "
                  f"{spec.dtype} with a {spec.kv_dtype} cache and head size {spec.head_dim}", file=sys.stderr, flush=True)
        self._lib = lib if fits else None
        if self._lib is not None and decode_mirror is None:
            decode_mirror = False  # decode steps read the cache in place: a mirror would be dead weight
        super().__init__(spec, device, decode_mirror=decode_mirror, **options)

    @property
    def uses_kernel(self) -> bool:
        return self._lib is not None

    def layer_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s [2, kv_heads, pages, page_size, head_dim] (chip_child.cpu_kernels.decode_layers)."""
        return self._layers[layer]

    def plan(self, meta: AttentionMetadata) -> StepPlan:
        if self._lib is None or not (meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs > 0):
            return super().plan(meta)
        self._check_bound()
        self._check_capacity(meta)
        step = StepPlan(meta)
        step.extra["kernel_decode"] = True
        step.extra["slots"] = meta.slot_mapping.to(torch.int64).contiguous()  # the kernel reads int64, once a step
        return step

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if not step.extra.get("kernel_decode"):
            return super().forward(layer, q, k, v, step, out)
        if self.decode_mirror:
            self.write_kv(layer, k, v, step.meta.slot_mapping)
            return self._attend_in_place(layer, q, step, out)
        self._check_bound()
        return self._attend_in_place(layer, q, step, out, (k, v, step.extra["slots"]))  # the kernel writes k, v

    def attend(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        if not step.extra.get("kernel_decode"):
            return super().attend(layer, q, step, out, k, v)
        self._check_bound()
        return self._attend_in_place(layer, q, step, out)

    def _attend_in_place(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None,
                         new_kv: tuple | None = None) -> torch.Tensor:
        meta, kv = step.meta, self._layers[layer]  # [2, kv_heads, pages, page_size, head_dim]
        table = meta.block_table if meta.block_table.stride(-1) == 1 else meta.block_table.contiguous()
        return decode_attention.attend(self._lib, q, kv[0], kv[1], table, meta.seq_lens.contiguous(),
                                       self.spec.softmax_scale, self._out(q, out), new_kv)

    # A mixed step's decode rows (TorchAttention._attend_general): their lengths and pages, then the kernel.
    def _decode_view(self, block_table: torch.Tensor, seq_lens: torch.Tensor, blocks: int) -> dict:
        if self._lib is None:
            return super()._decode_view(block_table, seq_lens, blocks)
        return dict(table=block_table.contiguous(), lens=seq_lens.contiguous(), rows=block_table.shape[0])

    def _attend_decode(self, layer: int, q: torch.Tensor, view: dict, out: torch.Tensor,
                       tokens: torch.Tensor | None = None) -> None:
        if self._lib is None:
            return super()._attend_decode(layer, q, view, out, tokens)
        kv = self._layers[layer]
        rows = q if tokens is None else q.index_select(0, tokens)
        got = decode_attention.attend(self._lib, rows, kv[0], kv[1], view["table"], view["lens"],
                                      self.spec.softmax_scale, out if tokens is None else torch.empty_like(rows))
        if tokens is not None:
            out.index_copy_(0, tokens, got)
