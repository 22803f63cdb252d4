"""The portable attention backend: plain torch ops, any device. The reference every other
backend is tested against.

Cache layout: [layers, 2 (k, v), kv_heads, pages, page_size, head_dim]. Heads are outermost so
that gathering a sequence's pages gives each kv head its keys contiguous, ready for one batched
matmul without repeating keys for grouped-query attention.

Paths, chosen per step by `plan`:

- pure decode (every sequence has one new token, T == N; no host read on this path unless the
  mirror is on): one gather of every row's pages per layer into the workspace, then
  baddbmm / softmax / bmm with a mask built once per step;
- pure decode with the *decode mirror* (cpu only; on by default there when the mirror takes at
  most `mirror_budget_bytes`): a persistent dense copy of every row's K/V, [layers, 2,
  max_seqs, kv_heads, max_context, head_dim]. Each decode step appends the new token to it next
  to the cache write, so steady decode reads K/V in place and copies nothing per layer. Rows
  are re-gathered from the cache only when their block table or length no longer continues
  what the mirror holds (after a prefill, an admission, a compaction of the batch); any write
  that is not a mirrored decode write makes every row stale. Its host bookkeeping costs about
  as much as a few small ops, so a step takes the mirror only when the gathers it saves reach
  `mirror_min_bytes` (4 MiB over all layers by default); scripts/bench_attention_cpu.py
  measures both paths;
- anything else (prefill chunks, mixed batches): decode rows together as above; a chunk with no
  cached context through SDPA's causal fast path on its own k/v; a chunk with cached context
  through SDPA over its gathered pages with a bottom-right causal mask.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from chip_child.attention.base import (AttentionBackend, AttentionMetadata, AttentionSpec, StepPlan, WorkspaceShapes,
                                       to_fp8)

MIRROR_BUDGET_BYTES = 1 << 30  # the largest mirror turned on by default
MIRROR_MIN_BYTES = 4 << 20  # the least a decode step must gather for the mirror to be used
MASK_TABLE_BYTES = 4 << 20  # the largest table of decode masks by length kept (see _bind_views)
MIRROR_CTX_ALIGN = 16  # a mirrored decode step attends over the longest row rounded up to this


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    if scores.dtype == torch.float32:
        return scores.softmax(-1)
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


class TorchAttention(AttentionBackend):
    name = "torch"
    cache_layout = "layer, k|v, kv_head, page, offset, head_dim"
    # Capturable with the decode mirror off (its bookkeeping is host work); off on accelerators.
    decode_capturable = True
    has_decode_mirror = True

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cpu", decode_mirror: bool | None = None,
                 mirror_budget_bytes: int = MIRROR_BUDGET_BYTES, mirror_min_bytes: int = MIRROR_MIN_BYTES):
        """`decode_mirror`: None turns it on for a cpu cache whose mirror takes at most
        `mirror_budget_bytes`; True insists (cpu only: it reads lengths on the host each step).
        With the mirror on, a decode step uses it when the gathers it replaces (all layers)
        reach `mirror_min_bytes`; smaller steps gather, and the mirror catches up (one gather
        of every row) at the first step that uses it."""
        super().__init__(spec, device)
        s = spec
        # An fp8 cache: written rounded, and read only through it (no mirror of fresh values), so a
        # token sees the same K/V however its step was made up (chunks, cache hits, a resume).
        self._fp8 = s.kv_dtype != s.dtype
        if self._fp8 and decode_mirror:
            raise ValueError("decode_mirror cannot be used with an fp8 cache")
        decode_mirror = False if self._fp8 else decode_mirror
        self._elem = torch.empty((), dtype=s.dtype).element_size()
        self.mirror_min_bytes = mirror_min_bytes
        self._mirror_bytes = s.num_layers * 2 * s.max_seqs * s.num_kv_heads * s.max_context * s.head_dim * self._elem
        if decode_mirror is None:
            decode_mirror = self.device.type == "cpu" and self._mirror_bytes <= mirror_budget_bytes
        elif decode_mirror and self.device.type != "cpu":
            raise ValueError(f"decode_mirror needs a cpu cache (it reads lengths on the host), got {self.device}")
        self.decode_mirror = bool(decode_mirror)
        self._mirror_len = np.zeros(s.max_seqs, np.int64)  # leading positions of each row equal to the cache
        self._mirror_table = np.zeros((s.max_seqs, s.max_blocks), np.int64)  # the pages those positions came from
        self._mirror_gen = 0  # bumped by every write that bypasses the mirror
        self._mirror_stale = False  # set by invalidate(): _mirror_len is to be cleared before use

    # ---- layout --------------------------------------------------------------------------
    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, 2, s.num_kv_heads, s.num_pages, s.page_size, s.head_dim)

    @property
    def workspace_shapes(self) -> WorkspaceShapes:
        s = self.spec
        shapes = {"gather": ((2, s.num_kv_heads, s.max_seqs * s.max_blocks, s.page_size, s.head_dim), s.dtype)}
        if self.decode_mirror:
            shapes["mirror"] = ((s.num_layers, 2, s.max_seqs, s.num_kv_heads, s.max_context, s.head_dim), s.dtype)
        return shapes

    def _bind_views(self) -> None:
        cache = self.kv_cache
        self._layers = list(cache.unbind(0))  # [2, kvh, pages, page, hd]
        self._slots = [c.flatten(2, 3) for c in self._layers]  # [2, kvh, slots, hd]
        # Token-major views of each layer's K and V slots, [slots, kvh, hd]: a write indexes
        # dim 0 with k/v [T, kvh, hd] as they come, no transpose per write.
        self._k_rows = [c[0].transpose(0, 1) for c in self._slots]
        self._v_rows = [c[1].transpose(0, 1) for c in self._slots]
        self._views: dict[tuple[int, int], tuple] = {}  # (rows, blocks) -> workspace views, see _gather_views
        self._key_index = torch.arange(self.spec.max_context, dtype=torch.int32, device=cache.device)
        self._zero = torch.zeros((), dtype=self.spec.dtype, device=cache.device)
        self._neg_inf = torch.full((), float("-inf"), dtype=self.spec.dtype, device=cache.device)
        # Row L: the additive decode mask of a sequence of length L (0 on keys 0..L-1, -inf
        # after), so a step's mask is one index_select by the lengths instead of a compare and
        # a where; kept only while small (max_context up to 1024 in fp32).
        ctx = self.spec.max_context
        self._mask_table = None
        if (ctx + 1) * ctx * self._elem <= MASK_TABLE_BYTES:
            lengths = torch.arange(ctx + 1, dtype=torch.int32, device=cache.device)
            visible = self._key_index[None, :] < lengths[:, None]
            self._mask_table = torch.where(visible, self._zero, self._neg_inf).unsqueeze(1)  # [ctx + 1, 1, ctx]
        if self.decode_mirror:
            mirror = self.workspace["mirror"]
            self._mirror_layers = list(mirror.unbind(0))  # [2, max_seqs, kvh, max_ctx, hd]
        self.invalidate()

    def invalidate(self) -> None:
        # Cheap, as every non-mirrored write calls it: _plan_mirror clears the lengths it reads.
        self._mirror_stale = True
        self._mirror_gen += 1

    # ---- writes --------------------------------------------------------------------------
    def _write_cache(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self._fp8:  # index_copy_ has no float8 kernel: the same bytes through uint8 views
            k, v = to_fp8(k).view(torch.uint8), to_fp8(v).view(torch.uint8)
            self._k_rows[layer].view(torch.uint8).index_copy_(0, slot_mapping, k)
            self._v_rows[layer].view(torch.uint8).index_copy_(0, slot_mapping, v)
            return
        self._k_rows[layer].index_copy_(0, slot_mapping, k)
        self._v_rows[layer].index_copy_(0, slot_mapping, v)

    def _gather(self, layer: int, pages: torch.Tensor, target: torch.Tensor) -> None:
        """Pages of a layer's K and V into the workspace (in the compute dtype)."""
        if self._fp8:
            target.copy_(self._layers[layer].index_select(2, pages))
        else:
            torch.index_select(self._layers[layer], 2, pages, out=target)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._check_bound()
        self._write_cache(layer, k, v, slot_mapping)
        if self.decode_mirror:
            self.invalidate()

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_bound()
        kv = self._slots[layer].index_select(2, slots.to(self.device, torch.int64))  # [2, kvh, n, hd]
        kv = kv.to(self.spec.dtype)
        return kv[0].transpose(0, 1), kv[1].transpose(0, 1)

    # ---- per step --------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> StepPlan:
        self._check_bound()
        self._check_capacity(meta)
        step = StepPlan(meta)
        n, t, page = meta.num_seqs, meta.num_tokens, self.spec.page_size
        blocks = max(1, math.ceil(meta.max_seq_len / page))
        step.extra["blocks"] = blocks
        if meta.max_query_len == 1 and t == n and n > 0:
            if self.decode_mirror and self._mirror_pays(n, blocks):
                self._plan_mirror(step, blocks)
            else:
                step.extra["decode"] = self._decode_view(meta.block_table, meta.seq_lens, blocks)
            return step
        step.extra["general"] = True
        return step

    def _decode_view(self, block_table: torch.Tensor, seq_lens: torch.Tensor, blocks: int) -> dict:
        """Gather index and mask for decode rows (one new token each) read through the cache."""
        s = self.spec
        rows = block_table.shape[0]
        target, keys_t, values, key_index, masks = self._gather_views(rows, blocks)
        lens = seq_lens if s.num_kv_heads == 1 else seq_lens.repeat(s.num_kv_heads)
        # [kvh * rows, 1, ctx]: 0 where the key is within the row's length, -inf past it.
        if masks is not None:
            bias = masks.index_select(0, lens)
        else:
            bias = torch.where(key_index < lens.view(-1, 1, 1), self._zero, self._neg_inf)
        # int32 or int64: index_select takes either.
        pages = block_table.reshape(-1) if blocks == block_table.shape[1] else block_table[:, :blocks].reshape(-1)
        return dict(pages=pages, target=target, keys_t=keys_t, values=values, bias=bias, rows=rows)

    def _gather_views(self, rows: int, blocks: int) -> tuple:
        """The workspace views a decode gather of `rows` rows x `blocks` pages uses (target,
        keys [kvh * rows, hd, ctx], values [kvh * rows, ctx, hd]) and the key positions
        [1, 1, ctx] and the mask table's first ctx keys (None without a table); made once per
        shape, as they only depend on the bound workspace."""
        views = self._views.get((rows, blocks))
        if views is None:
            s = self.spec
            ctx = blocks * s.page_size
            target = self.workspace["gather"].view(-1)[:2 * s.num_kv_heads * rows * ctx * s.head_dim]
            target = target.view(2, s.num_kv_heads, rows * blocks, s.page_size, s.head_dim)
            flat = target.view(2, s.num_kv_heads * rows, ctx, s.head_dim)  # row r of kv head j at j * rows + r
            masks = None if self._mask_table is None else self._mask_table[:, :, :ctx]
            views = (target, flat[0].transpose(1, 2), flat[1], self._key_index[:ctx].view(1, 1, ctx), masks)
            self._views[(rows, blocks)] = views
        return views

    def _mirror_pays(self, rows: int, blocks: int) -> bool:
        """Whether the gathers this decode step would make (every layer, K and V) are large
        enough for the mirror's host bookkeeping to pay."""
        s = self.spec
        gathered = s.num_layers * 2 * rows * blocks * s.page_size * s.num_kv_heads * s.head_dim * self._elem
        return gathered >= self.mirror_min_bytes

    def _plan_mirror(self, step: StepPlan, blocks: int) -> None:
        """Decode through the mirror: re-gather the rows it no longer holds, then say where
        each layer appends its new token. Host work in numpy: the mirror lives on the cpu."""
        meta, s = step.meta, self.spec
        page, n, kvh = s.page_size, meta.num_seqs, s.num_kv_heads
        if self._mirror_stale:
            self._mirror_len[:] = 0
            self._mirror_stale = False
        lens = np.asarray(meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist(), np.int64)
        table = meta.block_table.numpy()[:, :blocks].astype(np.int64)
        slots = meta.slot_mapping.numpy()
        prev = lens - 1  # positions already in the cache before this step
        prev_blocks = -(-prev // page)
        used = np.arange(blocks)[None, :] < prev_blocks[:, None]
        same = ((self._mirror_table[:n, :blocks] == table) | ~used).all(1)
        valid = (self._mirror_len[:n] >= prev) & same
        for r in np.flatnonzero(~valid):
            nb = int(prev_blocks[r])
            if nb:
                src = torch.from_numpy(table[r, :nb])
                dst = self.workspace["mirror"][:, :, r].unflatten(3, (s.max_blocks, page))[:, :, :, :nb]
                dst.copy_(self.kv_cache.index_select(3, src))  # every layer's pages of row r
        # After this step the row holds its new token too, if the token's slot is where the
        # block table says; a token written elsewhere in page 0 (an idle row) leaves the row's
        # older positions intact; anywhere else, no row can be trusted.
        expected = table[np.arange(n), prev // page] * page + prev % page
        consistent = slots[:n] == expected
        self._mirror_table[:n, :blocks] = table
        self._mirror_len[:n] = np.where(consistent, lens, prev)
        if not np.all(consistent | (slots[:n] < page)):
            self._mirror_len[:] = 0
        self._mirror_len[n:] = 0  # rows past this step's batch are not maintained
        # Keys past the longest row are masked anyway: not the whole last page, as the gather
        # path must (it copies pages), but the longest row rounded up.
        ctx = min(blocks * page, -(-int(lens.max()) // MIRROR_CTX_ALIGN) * MIRROR_CTX_ALIGN)
        visible = np.arange(ctx)[None, :] < np.repeat(lens, kvh)[:, None]  # row s * kvh + j
        bias = torch.from_numpy(np.where(visible, np.float32(0), np.float32(-np.inf)))
        bias = bias if s.dtype == torch.float32 else bias.to(s.dtype)
        rows = torch.from_numpy(np.arange(n)[:, None])
        index = (rows, torch.arange(kvh)[None, :], torch.from_numpy(prev[:, None]))  # broadcast to [n, kvh]
        step.extra["mirror"] = dict(bias=bias.unsqueeze(1), index=index, ctx=ctx, gen=self._mirror_gen)

    # ---- attention -------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        view = step.extra.get("decode")
        if view is not None:  # pure decode through the gather
            self._write_cache(layer, k, v, step.meta.slot_mapping)
            if self.decode_mirror:
                self.invalidate()
            return self._attend_rows(layer, q, view, out)
        mirror = step.extra.get("mirror")
        if mirror is not None and mirror["gen"] == self._mirror_gen:
            self._check_bound()
            self._write_cache(layer, k, v, step.meta.slot_mapping)
            kv = self._mirror_layers[layer]  # [2, max_seqs, kvh, max_ctx, hd]
            kv[0].index_put_(mirror["index"], k)
            kv[1].index_put_(mirror["index"], v)
            return self._attend_mirror(layer, q, mirror, self._out(q, out))
        self.write_kv(layer, k, v, step.meta.slot_mapping)
        return self.attend(layer, q, step, out=out, k=k, v=v)

    def attend(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        self._check_bound()
        mirror = step.extra.get("mirror")
        if mirror is not None:
            if mirror["gen"] == self._mirror_gen:
                return self._attend_mirror(layer, q, mirror, self._out(q, out))
            # Something wrote the cache after the plan: read it as the gather path does.
            step.extra["decode"] = self._decode_view(step.meta.block_table, step.meta.seq_lens, step.extra["blocks"])
            del step.extra["mirror"]
        view = step.extra.get("decode")
        if view is not None:
            return self._attend_rows(layer, q, view, out)
        return self._attend_general(layer, q, step, self._out(q, out), k, v)

    def _attend_mirror(self, layer: int, q: torch.Tensor, mirror: dict, out: torch.Tensor) -> torch.Tensor:
        s = self.spec
        n, kvh, g, hd = q.shape[0], s.num_kv_heads, s.group, s.head_dim
        kv = self._mirror_layers[layer][:, :n, :, :mirror["ctx"]]  # [2, n, kvh, ctx, hd], in place
        keys, values = kv[0].flatten(0, 1), kv[1].flatten(0, 1)  # [n * kvh, ctx, hd]
        qg = q.reshape(n * kvh, g, hd)
        scores = torch.baddbmm(mirror["bias"], qg, keys.transpose(1, 2), alpha=s.softmax_scale)
        torch.bmm(_softmax(scores), values, out=out.view(n * kvh, g, hd))
        return out

    def _attend_rows(self, layer: int, q: torch.Tensor, view: dict, out: torch.Tensor | None) -> torch.Tensor:
        """Pure decode (q's token i is row i's new token): into `out` when given, else the
        result of the last matmul itself (a view of it), with no copy."""
        s = self.spec
        self._gather(layer, view["pages"], view["target"])
        rows, kvh, g, hd = view["rows"], s.num_kv_heads, s.group, s.head_dim
        if out is not None:
            out = self._out(q, out)
        if kvh == 1:  # q [rows, heads, hd] is already the batch of [heads, hd] queries per row
            scores = torch.baddbmm(view["bias"], q, view["keys_t"], alpha=s.softmax_scale)
            if out is None:
                return torch.bmm(_softmax(scores), view["values"])
            torch.bmm(_softmax(scores), view["values"], out=out)
            return out
        qg = q.reshape(rows, kvh, g, hd).transpose(0, 1).reshape(kvh * rows, g, hd)
        scores = torch.baddbmm(view["bias"], qg, view["keys_t"], alpha=s.softmax_scale)
        o = torch.bmm(_softmax(scores), view["values"]).view(kvh, rows, g, hd).transpose(0, 1)
        if out is None:
            return o.reshape(rows, kvh * g, hd)
        out.view(rows, kvh, g, hd).copy_(o)
        return out

    def _attend_decode(self, layer: int, q: torch.Tensor, view: dict, out: torch.Tensor,
                       tokens: torch.Tensor | None = None) -> None:
        """One new token per row; `tokens` says which rows of q/out (all, in order, when None)."""
        s = self.spec
        self._gather(layer, view["pages"], view["target"])
        rows, kvh, g, hd = view["rows"], s.num_kv_heads, s.group, s.head_dim
        qr = q if tokens is None else q.index_select(0, tokens)
        qg = qr.reshape(rows, kvh, g, hd).transpose(0, 1).reshape(kvh * rows, g, hd)
        scores = torch.baddbmm(view["bias"], qg, view["keys_t"], alpha=s.softmax_scale)
        o = torch.bmm(_softmax(scores), view["values"]).view(kvh, rows, g, hd).transpose(0, 1)
        if tokens is None:
            out.view(rows, kvh, g, hd).copy_(o)
        else:
            out.index_copy_(0, tokens, o.reshape(rows, s.num_heads, hd))

    def _attend_general(self, layer: int, q: torch.Tensor, step: StepPlan, out: torch.Tensor,
                        k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        meta, s = step.meta, self.spec
        if "host" not in step.extra:
            q_lens, s_lens = meta.host_lengths()
            starts = [0]
            for ql in q_lens:
                starts.append(starts[-1] + ql)
            decode_rows = [i for i, ql in enumerate(q_lens) if ql == 1]
            decode = None
            if decode_rows:
                rows_t = torch.tensor(decode_rows, device=self.device)
                blocks = max(1, math.ceil(max(s_lens[i] for i in decode_rows) / s.page_size))
                view = self._decode_view(meta.block_table.index_select(0, rows_t),
                                         meta.seq_lens.index_select(0, rows_t), blocks)
                decode = (view, torch.tensor([starts[i] for i in decode_rows], device=self.device))
            chunks = [(i, starts[i], q_lens[i], s_lens[i]) for i, ql in enumerate(q_lens) if ql > 1]
            step.extra["host"] = (decode, chunks)
        decode, chunks = step.extra["host"]
        if decode is not None:
            self._attend_decode(layer, q, decode[0], out, tokens=decode[1])
        scale = s.softmax_scale
        for seq, start, ql, sl in chunks:
            qs = q[start:start + ql].transpose(0, 1).unsqueeze(0)  # [1, heads, ql, hd]
            if sl == ql and k is not None and v is not None:
                ks = k[start:start + ql].transpose(0, 1).unsqueeze(0)
                vs = v[start:start + ql].transpose(0, 1).unsqueeze(0)
                if self._fp8:  # what a later read of the cache gives
                    ks, vs = to_fp8(ks).to(s.dtype), to_fp8(vs).to(s.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                nb = math.ceil(sl / s.page_size)
                pages = meta.block_table[seq, :nb].to(torch.int64)
                kv = self._layers[layer].index_select(2, pages).flatten(2, 3)[:, :, :sl].to(s.dtype)  # [2, kvh, sl, hd]
                # Token i of the chunk sits at position sl - ql + i and sees keys 0..that position.
                mask = (torch.arange(sl, device=self.device)[None, :]
                        <= torch.arange(sl - ql, sl, device=self.device)[:, None])
                o = F.scaled_dot_product_attention(qs, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=mask,
                                                   scale=scale, enable_gqa=True)
            out[start:start + ql].copy_(o[0].transpose(0, 1))
        return out
