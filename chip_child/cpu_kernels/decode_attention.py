"""Decode attention read in place from the paged cache (decode_attention.cpp on AVX-512, or
decode_attention_avx2.cpp on a cpu with only AVX2): one call per layer for every decode row, bf16
or float32, no gather and no dense mirror. chip_child.attention.cpu_backend calls it for pure
decode steps; each kernel checks itself once against a plain torch softmax attention over a
shuffled paged cache and, where neither can run, the torch backend's own decode paths serve those
steps (chip_child.cpu_kernels.build.CheckedKernel)."""
from __future__ import annotations

import ctypes
import math

import torch

from chip_child.cpu_kernels.build import AVX2_FMA, AVX2_FMA_FLAGS, CheckedKernel, first_usable

CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the largest output
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
DTYPES = (torch.float32, torch.bfloat16)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.l3_decode_attention.argtypes = [_INT, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64,
                                        _I64, _I64, _F32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _INT]
    lib.l3_decode_attention.restype = None
    return lib


def supports(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this model's attention: its dtype and head size."""
    return dtype in DTYPES and head_dim <= lib.l3_decode_attention_max_head_dim()


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] with each row's heads contiguous (rows may be strided)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def attend(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           threads: int | None = None) -> torch.Tensor:
    """q [rows, heads, head_dim]; k_cache, v_cache one layer's [kv_heads, pages, page_size,
    head_dim] (contiguous from the page on); block_table int32 [rows, >= pages a row uses]; seq_lens
    int32 [rows], the new token included; out like q. The new tokens' keys and values are in the
    cache already, or `new_kv` = (k, v [rows, kv_heads, head_dim], slots [rows]) has the kernel
    write them first (page * page_size + offset, as a slot mapping). `threads`: torch's by default;
    -1 - pair runs only that (row, kv head) pair on this thread, as the decode step's team does."""
    rows, heads, hd = q.shape
    kvh, _, page_size, _ = k_cache.shape
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:  # read through raw pointers
        raise ValueError(f"block_table and seq_lens must be int32, got {block_table.dtype} and {seq_lens.dtype}")
    q = _heads_contiguous(q)
    nk = nv = slots = None
    if new_kv is not None:
        nk, nv = (_heads_contiguous(x.to(k_cache.dtype)) for x in new_kv[:2])
        slots = new_kv[2].to(torch.int64).contiguous()
        if nk.shape != (rows, kvh, hd) or nv.shape != nk.shape or slots.shape != (rows,):
            raise ValueError(f"new_kv: k and v must be [{rows}, {kvh}, {hd}] and slots [{rows}], got "
                             f"{tuple(nk.shape)}, {tuple(nv.shape)} and {tuple(slots.shape)}")
    lib.l3_decode_attention(int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), block_table.data_ptr(),
                            block_table.stride(0), seq_lens.data_ptr(), rows, kvh, heads // kvh, hd, page_size, scale,
                            out.data_ptr(), out.stride(0), None if nk is None else nk.data_ptr(),
                            0 if nk is None else nk.stride(0), None if nv is None else nv.data_ptr(),
                            0 if nv is None else nv.stride(0), None if slots is None else slots.data_ptr(),
                            torch.get_num_threads() if threads is None else threads)
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in float32 torch ops, row by row."""
    rows, heads, hd = q.shape
    kvh, _, page_size, _ = k_cache.shape
    out = torch.empty(rows, heads, hd)
    for r in range(rows):
        n = int(seq_lens[r])
        pages = block_table[r, :math.ceil(n / page_size)].long()
        k = k_cache[:, pages].reshape(kvh, -1, hd)[:, :n].float().repeat_interleave(heads // kvh, 0)
        v = v_cache[:, pages].reshape(kvh, -1, hd)[:, :n].float().repeat_interleave(heads // kvh, 0)
        p = (q[r].float().unsqueeze(1) @ k.transpose(1, 2) * scale).softmax(-1)  # [heads, 1, n]
        out[r] = (p @ v).squeeze(1)
    return out


def check_error(lib: ctypes.CDLL) -> float:
    """Largest relative error against `reference` over both dtypes, a GQA group of 3, partial
    last pages, context lengths from 1 to 61 (16 pages of 4), pages in shuffled order; infinite
    where the kernel's own write of the new keys and values (`new_kv`) differs from the cache's
    bits or changes the output."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for dtype in DTYPES:
        kvh, group, hd, page, pages = 2, 3, 40, 4, 64  # 40: two whole vectors and a half
        lens = torch.tensor([1, 7, 16, 61], dtype=torch.int32)
        table = torch.randperm(pages, generator=g).to(torch.int32).view(4, 16)
        k, v = (torch.randn(kvh, pages, page, hd, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(4, kvh * group, hd, generator=g).to(dtype)
        want = reference(q, k, v, table, lens, 0.125)
        got = attend(lib, q, k, v, table, lens, 0.125, torch.empty_like(q)).float()
        # The same with each row's last key and value handed to the kernel: the cache must get their bits.
        last = lens.long() - 1
        slots = table[torch.arange(4), last // page].long() * page + last % page
        k_rows, v_rows = (x.permute(1, 2, 0, 3).reshape(pages * page, kvh, hd) for x in (k, v))
        new = (k_rows[slots], v_rows[slots], slots)  # copies: indexing by a tensor gathers
        k2, v2 = k.clone(), v.clone()
        for x in (k2, v2):
            x.view(kvh, pages * page, hd)[:, slots] = 0
        got_new = attend(lib, q, k2, v2, table, lens, 0.125, torch.empty_like(q), new_kv=new).float()
        if not (torch.isfinite(got).all() and torch.equal(k2, k) and torch.equal(v2, v) and torch.equal(got_new, got)):
            return float("inf")
        error = ((got - want).abs().max() / want.abs().max()).item()
        worst = max(worst, error * CHECK_TOLERANCE[torch.float32] / CHECK_TOLERANCE[dtype])  # in float32's terms
    return worst


def _bind_limits(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.l3_decode_attention_max_head_dim.restype = _INT
    return _bind(lib)


KERNEL = CheckedKernel("cpu_decode_attention", "decode_attention.cpp",
                       "decode attention runs on the next that can (the AVX2 kernel, torch ops)", _bind_limits,
                       check_error, CHECK_TOLERANCE[torch.float32])
# The same function on AVX2 + FMA (decode_attention_avx2.cpp), used only where KERNEL cannot run.
AVX2_KERNEL = CheckedKernel("cpu_decode_attention_avx2", "decode_attention_avx2.cpp",
                            "decode attention runs on torch ops", _bind_limits, check_error,
                            CHECK_TOLERANCE[torch.float32], cpu_flags=AVX2_FMA, compile_flags=AVX2_FMA_FLAGS)


def library() -> ctypes.CDLL | None:
    """The first of KERNEL and AVX2_KERNEL that runs here, or None.
    `L3WORKER_REFERENCE_KERNELS=cpu_decode_attention` turns both off, `cpu_decode_attention_avx2`
    the second."""
    kernel = first_usable(KERNEL, AVX2_KERNEL)
    return None if kernel is None else kernel.library()
