"""bf16 projections on AMX tiles (bf16_amx.cpp), on the matrices bf16_linear packs: where the cpu
has AMX, every bf16 matrix whose K is a multiple of 32 runs here at every row count, so a matrix
gives the same bits whatever the batch (chip_child.models.prepack chooses per matrix, at load).

On the 2-core CI machine (`python scripts/bench_cpu_gemm.py`), the twelve layers of a 128M Qwen3's
projections: 16 rows took 0.5x the AVX-512 kernel's time and a 128-row prompt chunk about 0.2x,
while 1 row reads the weights as fast (see docs/performance/cpu.md#amx-projections).

KERNEL builds, loads and checks it once per process against a float32 matmul (a partial block of
outputs, a partial row tile, a bias). Where it cannot run (no AMX, a kernel that refuses this
process its tiles, a compiler without -mamx-bf16, a failed check, or
`L3WORKER_REFERENCE_KERNELS=cpu_bf16_amx`) the projections stay on the AVX-512 kernel, and the
reason is printed once."""
from __future__ import annotations

import ctypes
import errno
import os

import torch

from chip_child.cpu_kernels import bf16_linear
from chip_child.cpu_kernels.build import AVX512_BF16, AVX512_BF16_FLAGS, CheckedKernel, KernelBuildError

K_MULTIPLE = 32  # the k of one tile: other matrices stay on the AVX-512 kernel
CHECK_SHAPES = ((1, 67, 64), (5, 130, 96), (16, 64, 768), (21, 200, 1024))  # (rows, out, in)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    bf16_linear.bind_packing(lib)
    lib.l3_bf16_amx_linear.argtypes, lib.l3_bf16_amx_linear.restype = bf16_linear.LINEAR_ARGTYPES, None
    lib.l3_amx_init.argtypes, lib.l3_amx_init.restype = [], ctypes.c_int
    code = lib.l3_amx_init()
    if code:
        raise KernelBuildError(f"the kernel refused this process AMX tiles ({errno.errorcode.get(code, code)}: "
                               f"{os.strerror(code)})")
    return lib


def fits(in_features: int) -> bool:
    return in_features % K_MULTIPLE == 0


def linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """As bf16_linear.linear, on AMX; x's last dimension a multiple of K_MULTIPLE."""
    x, bias = bf16_linear.prepare_inputs(x, bias)
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    if rows:
        lib.l3_bf16_amx_linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, rows,
                               out_features, k, torch.get_num_threads())
    return y


def check_error(lib: ctypes.CDLL) -> float:
    return bf16_linear.worst_error(lib, linear, CHECK_SHAPES)


KERNEL = CheckedKernel("cpu_bf16_amx", "bf16_amx.cpp", "bf16 projections run on the AVX-512 kernel", _bind,
                       check_error, bf16_linear.CHECK_TOLERANCE, cpu_flags=(*AVX512_BF16, "amx_tile", "amx_bf16"),
                       compile_flags=[*AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-bf16"])
