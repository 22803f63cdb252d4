"""bf16 projections on AVX-512 BF16 (bf16_linear.cpp), or on AVX2 + FMA (bf16_linear_avx2.cpp) where
the cpu lacks AVX-512 BF16: the weight packed once at load, then any number of rows per call, each
thread streaming its share of the weight once.

Measured on the 2-core CI machine (`python scripts/bench_cpu_gemm.py`), the twelve layers of a
128M Qwen3's projections: at 1 row it reads the weights at about 31 GB/s where oneDNN's prepacked
op reaches about 19-23, and from 16 rows on it computes at 300-430 GFLOPS, at or above oneDNN.

KERNEL and AVX2_KERNEL build, load and check themselves once per process against a float32 matmul
on odd shapes (a partial block of outputs, an odd k, a bias); where neither can run (no compiler, a
failed build or check, `L3WORKER_REFERENCE_KERNELS=cpu_bf16_linear,cpu_bf16_linear_avx2`) the
projections stay on oneDNN (or torch.mm where oneDNN has no bf16), the reasons printed once
(chip_child.cpu_kernels.build.CheckedKernel)."""
from __future__ import annotations

import ctypes

import torch

from chip_child.cpu_kernels.build import AVX2_FMA, AVX2_FMA_FLAGS, CheckedKernel, first_usable
from chip_child.cpu_kernels.huge_pages import huge_page_empty

# Largest error allowed against the float32 reference, relative to its largest magnitude: the
# kernel rounds its fp32 sums to bf16 once (2^-8 relative) and sums in another order than torch.
CHECK_TOLERANCE = 1e-2
CHECK_SHAPES = ((1, 67, 33), (5, 130, 64), (16, 64, 768))  # (rows, out, in)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


# (x, ldx, packed, bias, y, ldy, M, N, K, threads): both kernels' linear functions
LINEAR_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT]


def bind_packing(lib: ctypes.CDLL) -> None:
    """The packing functions bf16_packing.h gives each kernel's library."""
    lib.l3_bf16_packed_elements.argtypes, lib.l3_bf16_packed_elements.restype = [_I64, _I64], _I64
    lib.l3_bf16_pack.argtypes, lib.l3_bf16_pack.restype = [_PTR, _I64, _I64, _I64, _PTR, _INT], None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    bind_packing(lib)
    lib.l3_bf16_linear.argtypes, lib.l3_bf16_linear.restype = LINEAR_ARGTYPES, None
    return lib


def pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] bf16 matrix in the kernel's blocked layout, a flat tensor on huge pages
    where the system gives them (every decode step streams it: chip_child.cpu_kernels.huge_pages)."""
    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    packed = huge_page_empty(lib.l3_bf16_packed_elements(n, k), torch.bfloat16)
    lib.l3_bf16_pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed


def linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] bf16 @ the packed [out, in] matrix^T (+ bias [out]) -> [rows, out] bf16."""
    x, bias = prepare_inputs(x, bias)
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    if rows:
        lib.l3_bf16_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                           y.data_ptr(), out_features, rows, out_features, k, torch.get_num_threads())
    return y


def prepare_inputs(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x as 2-d rows of unit stride and bias as contiguous bf16, as both kernels read them."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the bf16 linear kernel takes bfloat16 inputs, got {x.dtype}")
    if x.stride(-1) != 1 or x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    return x, bias


def worst_error(lib: ctypes.CDLL, linear_fn, shapes) -> float:
    """A kernel's largest relative error against a float32 matmul over `shapes` (rows, out, in),
    each with and without a bias, its input not at the start of its storage."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, n, k in shapes:
        w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((n, k), (rows + 1, k), (n,)))
        x = x[1:]  # an input that does not start its storage
        for bias in (None, b):
            want = x.float() @ w.float().t() + (0 if bias is None else bias.float())
            got = linear_fn(lib, x, pack(lib, w), n, bias).float()
            if not torch.isfinite(got).all():
                return float("inf")
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def check_error(lib: ctypes.CDLL) -> float:
    return worst_error(lib, linear, CHECK_SHAPES)


KERNEL = CheckedKernel("cpu_bf16_linear", "bf16_linear.cpp",
                       "bf16 projections run on the next that can (the AVX2 kernel, oneDNN, torch.mm)", _bind,
                       check_error, CHECK_TOLERANCE)

# The same functions and packed layout on AVX2 + FMA (bf16_linear_avx2.cpp), for the cpus without
# AVX-512 BF16; used only where KERNEL cannot run.
AVX2_KERNEL = CheckedKernel("cpu_bf16_linear_avx2", "bf16_linear_avx2.cpp",
                            "bf16 projections run on oneDNN (or torch.mm where it has no bf16)",
                            _bind, check_error, CHECK_TOLERANCE, cpu_flags=AVX2_FMA, compile_flags=AVX2_FMA_FLAGS)


def best_kernel() -> tuple[str, ctypes.CDLL] | None:
    """("avx512_bf16" or "avx2_bf16", its library) for the first of the two that runs here; else None.
    `L3WORKER_REFERENCE_KERNELS=cpu_bf16_linear` turns both off, `cpu_bf16_linear_avx2` the second."""
    kernel = first_usable(KERNEL, AVX2_KERNEL)
    if kernel is None:
        return None
    return ("avx512_bf16" if kernel is KERNEL else "avx2_bf16"), kernel.library()
