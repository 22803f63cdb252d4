"""The attention backend interface: how the model writes K/V into the paged cache and attends
over it, whatever the device.

Terms
-----
- A *page* holds `page_size` consecutive positions of one sequence. Page ids index the cache;
  page 0 is scratch: idle or padded rows write there, and no sequence ever reads it.
- A *slot* is one position of one page: ``slot = page_id * page_size + offset``.
- A step runs N sequences. Sequence s brings ``q_len_s >= 0`` new tokens; its context is
  ``seq_lens[s]`` positions *including* those new tokens. A decode row is a sequence with one new
  token; a prefill chunk has several, with or without context cached by earlier steps.

Per step the caller builds one `AttentionMetadata`:

- ``query_start_loc``: int32 [N + 1], cumulative starts of each sequence's new tokens in the
  packed token axis (``query_start_loc[0] == 0``); ``q_len_s = query_start_loc[s+1] -
  query_start_loc[s]``. Tokens past ``query_start_loc[N]`` are padding: their output rows are
  unspecified.
- ``seq_lens``: int32 [N], with ``seq_lens[s] >= q_len_s``.
- ``block_table``: int32 [N, W], the page ids of each sequence in order. Columns up to
  ``ceil(max_seq_len / page_size)`` are read and must hold valid page ids (0 where unused).
- ``slot_mapping``: int32 or int64 [T], where each new token's K/V goes (0 for padding).
- ``max_query_len`` / ``max_seq_len``: host ints, upper bounds of q_len and seq_len over the
  batch. Exact values give the least work; any larger value is correct (a captured graph uses
  the bucket's bound). They size grids and gathers so that no kernel needs a host sync.
- ``query_lens_host`` / ``seq_lens_host``: optional host copies of the lengths. Backends whose
  vendor op takes host lists (npu) or whose general path loops over sequences (torch) read
  them from here, and only read the device tensors when they are missing.

Everything that varies per step lives in device tensors; the host ints are bounds. A CUDA graph
captured with fixed bounds therefore replays correctly for any batch within them.

Semantics
---------
New token i of sequence s sits at absolute position ``p = seq_lens[s] - q_len_s + i`` and
attends causally to keys 0..p of its own sequence, read from the cache through its block
table. Keys at positions below ``seq_lens[s] - q_len_s`` were written by earlier steps; the
new tokens' keys are written by this step's `write_kv`, which runs before attention.

- q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (views are fine: strides are
  honoured or copied as a backend needs).
- Grouped-query attention: ``num_heads % num_kv_heads == 0``; query head h reads kv head
  ``h // (num_heads // num_kv_heads)``.
- scores are ``scale * q.k`` (``spec.scale``, default ``head_dim ** -0.5``); softmax in fp32;
  the output is [T, num_heads, head_dim] in q's dtype.

The contract the cache relies on: a new token's slot is the one its sequence's block table
gives for its position. Only rows whose output nobody reads (idle or padding rows) may write
elsewhere, and then into page 0; their output is unspecified. Pages shared between sequences
(a cached prefix) are full and never written while shared.

Using a backend
---------------
::

    Backend = get_backend(device.type, name)          # a class; see chip_child.attention
    attn = Backend(spec, device)                      # validates the spec (ValueError naming the field)
    cache = pool.get(..., attn.kv_cache_shape, spec.kv_dtype)        # every layer at once
    ws = {n: pool.get(..., s, d) for n, (s, d) in attn.workspace_shapes.items()}
    attn.bind(cache, ws)                              # or attn.allocate(device)
    ...
    step = attn.plan(meta)                            # once per step, before layer 0
    for layer in range(num_layers):
        ...
        o = attn.forward(layer, q, k, v, step, out=o_buf)   # write_kv, then attention

`plan` does the per-step work every layer shares. What it may do on the host differs: the
triton backend only does arithmetic on the host ints (grid, block sizes, split count); the torch
backend's pure-decode path only launches device ops (its mirror and its mixed-batch path read
lengths on the host, which is free on the cpu); the npu backend hands host length lists to the
vendor op. To capture a decode step in a CUDA graph: keep the metadata tensors at fixed
addresses, capture `plan` (made with the bucket's bounds: max_query_len=1, max_seq_len = the
bucket's longest context) together with every layer's `forward`, and before each replay only
copy the new lengths, starts, block-table entries and slots into those tensors; the device ops
of the plan (the torch backend's mask) replay with them, its host arithmetic (the triton grid)
holds for any batch within the bounds. Pass int32 starts, lengths and block table: a backend
converts other dtypes with a copy in `plan`.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import torch

from chip_child.config import KV_CACHE_DTYPES

WorkspaceShapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def cache_dtype_of(kv_cache_dtype: str) -> torch.dtype | None:
    """RuntimeConfig.kv_cache_dtype as the cache's dtype; None: the model's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return None if kv_cache_dtype == "auto" else torch.float8_e4m3fn


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: larger K/V values saturate there


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """K/V values as float8 e4m3 with a per-tensor scale of 1 (a cast would turn overflow into
    NaN). Every backend that writes an fp8 cache rounds through this one function."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class AttentionSpec:
    """The model's attention geometry and the cache's capacity. Fixed for a runtime's life.

    `max_tokens` bounds T (new tokens in one step), `max_seqs` bounds N, `max_blocks` is the
    block table's width (pages one sequence may hold). `num_pages` counts page 0."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    max_tokens: int
    max_seqs: int
    max_blocks: int
    scale: float | None = None
    cache_dtype: torch.dtype | None = None  # the KV pages' dtype when it is not `dtype` (fp8)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "page_size", "max_tokens",
                     "max_seqs", "max_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the cache stores: `cache_dtype`, else the compute dtype."""
        return self.cache_dtype or self.dtype

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    @property
    def max_context(self) -> int:
        """The longest context a block table row can describe."""
        return self.max_blocks * self.page_size


@dataclass
class AttentionMetadata:
    """What one step's attention needs; see the module docstring for each field's meaning."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_host: Sequence[int] | None = None
    seq_lens_host: Sequence[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """(query lengths, seq lengths) as host lists: the given copies, else read from the
        device tensors (a host sync on accelerators)."""
        if self.query_lens_host is not None:
            q_lens = list(self.query_lens_host)
        else:
            starts = self.query_start_loc.tolist()
            q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        s_lens = list(self.seq_lens_host) if self.seq_lens_host is not None else self.seq_lens.tolist()
        return q_lens, s_lens

    @classmethod
    def from_lengths(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_table: torch.Tensor,
                     page_size: int, device: torch.device | str | None = None,
                     pad_tokens_to: int | None = None) -> "AttentionMetadata":
        """Builds a step's metadata from host lengths and a block table: query_start_loc, and
        each new token's slot from its position and its sequence's pages. With `pad_tokens_to`
        the token axis is padded to that length with slot 0 (the scratch page)."""
        if len(query_lens) != len(seq_lens) or block_table.shape[0] != len(seq_lens):
            raise ValueError("query_lens, seq_lens and block_table must describe the same sequences")
        device = block_table.device if device is None else torch.device(device)
        table = block_table.to("cpu", torch.int64)
        slots: list[int] = []
        for s, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
            if not 0 <= ql <= sl:
                raise ValueError(f"sequence {s}: query length {ql} must be within 0..seq_len={sl}")
            if sl > table.shape[1] * page_size:
                raise ValueError(f"sequence {s}: seq_len={sl} needs more pages than block_table has")
            positions = torch.arange(sl - ql, sl)
            slots += (table[s, positions // page_size] * page_size + positions % page_size).tolist()
        total = len(slots)
        if pad_tokens_to is not None:
            if pad_tokens_to < total:
                raise ValueError(f"pad_tokens_to={pad_tokens_to} is below the {total} tokens of the step")
            slots += [0] * (pad_tokens_to - total)
        starts = [0]
        for ql in query_lens:
            starts.append(starts[-1] + ql)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(query_start_loc=torch.tensor(starts, **i32), seq_lens=torch.tensor(list(seq_lens), **i32),
                   block_table=block_table.to(device=device, dtype=torch.int32),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
                   query_lens_host=list(query_lens), seq_lens_host=list(seq_lens))


@dataclass
class StepPlan:
    """What every layer of one step shares, made once by `AttentionBackend.plan`. Backends
    keep their own per-step state in `extra`."""

    meta: AttentionMetadata
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """One way of storing K/V and attending over it. Subclasses say which cache layout they
    want (`kv_cache_shape`, `cache_layout`) and which scratch tensors (`workspace_shapes`);
    the caller allocates both (from its pool, once) and binds them."""

    name: ClassVar[str]
    has_decode_mirror: ClassVar[bool] = False  # takes the `decode_mirror` option (the torch backend and its subclasses)
    cache_layout: ClassVar[str]  # the cache's dimensions, outermost first
    # Whether a pure-decode `plan` given no host lengths does only device work and host
    # arithmetic on the bound ints, so a captured graph replays it correctly for any batch.
    decode_capturable: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.validate(spec)
        self.kv_cache: torch.Tensor | None = None
        self.workspace: dict[str, torch.Tensor] = {}

    # ---- layout --------------------------------------------------------------------------
    @classmethod
    def validate(cls, spec: AttentionSpec) -> None:
        """Raises ValueError naming the field when this backend cannot serve `spec`."""

    @property
    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, ...]:
        """The whole model's cache (every layer, K and V) as one tensor of `spec.kv_dtype`."""

    @property
    def workspace_shapes(self) -> WorkspaceShapes:
        """Scratch tensors the backend needs, by name: (shape, dtype). Allocated once."""
        return {}

    def bind(self, kv_cache: torch.Tensor, workspace: Mapping[str, torch.Tensor] | None = None) -> "AttentionBackend":
        """Adopts the cache (and workspace) the caller allocated; builds per-layer views."""
        if tuple(kv_cache.shape) != self.kv_cache_shape or kv_cache.dtype != self.spec.kv_dtype:
            raise ValueError(f"kv_cache: expected {self.kv_cache_shape} {self.spec.kv_dtype}, got "
                             f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        workspace = dict(workspace or {})
        for name, (shape, dtype) in self.workspace_shapes.items():
            t = workspace.get(name)
            if t is None or t.numel() < math.prod(shape) or t.dtype != dtype or t.device != kv_cache.device:
                raise ValueError(f"workspace {name!r}: expected {shape} {dtype} on {kv_cache.device}")
            workspace[name] = t.reshape(-1)[:math.prod(shape)].view(shape)
        self.kv_cache = kv_cache
        self.workspace = workspace
        self.device = kv_cache.device
        self._bind_views()
        return self

    def allocate(self, device: torch.device | str | None = None) -> "AttentionBackend":
        """Allocates a zeroed cache and workspace and binds them (tests, scripts)."""
        device = self.device if device is None else torch.device(device)
        cache = torch.zeros(self.kv_cache_shape, dtype=self.spec.kv_dtype, device=device)
        ws = {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in self.workspace_shapes.items()}
        return self.bind(cache, ws)

    def _bind_views(self) -> None:
        """Per-layer views of the bound cache; made once, never per step."""

    def invalidate(self) -> None:
        """Call after anything wrote the cache other than this backend (zeroing it, say)."""

    # ---- per step --------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> StepPlan:
        """Whatever all layers of this step share (masks, gather indices, grid sizes)."""
        return StepPlan(meta)

    @abstractmethod
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, num_kv_heads, head_dim] into the slots `slot_mapping` [T] names."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, num_heads, head_dim] over the cache; into `out` when given.
        `k`, `v` are this step's new keys and values, already written; a backend may use them
        for chunks without cached context instead of reading them back."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes this step's K/V by `step.meta.slot_mapping`, then attends."""
        self.write_kv(layer, k, v, step.meta.slot_mapping)
        return self.attend(layer, q, step, out=out, k=k, v=v)

    @abstractmethod
    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, num_kv_heads, head_dim] stored at `slots`, whatever the layout."""

    # ---- helpers ---------------------------------------------------------------------------
    def _check_bound(self) -> None:
        if self.kv_cache is None:
            raise RuntimeError(f"{type(self).__name__}: bind() or allocate() a cache first")

    def _check_capacity(self, meta: AttentionMetadata) -> None:
        s = self.spec
        if meta.num_seqs > s.max_seqs or meta.num_tokens > s.max_tokens:
            raise ValueError(f"a step of {meta.num_seqs} sequences and {meta.num_tokens} tokens exceeds "
                             f"max_seqs={s.max_seqs} / max_tokens={s.max_tokens}")
        if meta.max_seq_len > s.max_context:
            raise ValueError(f"max_seq_len={meta.max_seq_len} exceeds max_blocks * page_size={s.max_context}")
        if meta.query_start_loc.shape[0] != meta.num_seqs + 1:
            raise ValueError("query_start_loc must have one entry more than seq_lens")

    def _out(self, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """A contiguous [T, heads, head_dim] result in q's dtype: `out`, or a new tensor."""
        if out is None:
            return torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {tuple(q.shape)} {q.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        return out
