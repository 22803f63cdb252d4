"""The seeded sampler's uniform noise on the cpu (sampling_noise.cpp): the same bits as the torch
version in chip_child.sampling.noise, in one pass over [rows, vocab] instead of a dozen int64
ops. KERNEL checks it once per process for exact equality with the torch version; where it
cannot run (no AVX2, no compiler, a failed build or check, `L3WORKER_REFERENCE_KERNELS=
cpu_sampling_noise`) the torch version runs and the reason is printed once."""
from __future__ import annotations

import ctypes

import torch

from chip_child.cpu_kernels.build import CheckedKernel
from chip_child.sampling.noise import torch_uniform_noise, vocab_hash
from chip_child.sampling.seeds import M32, hash32, unhash32

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
COMPILE_FLAGS = ["-std=c++17", "-O3", "-mavx2", "-fopenmp"]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.l3_uniform_noise.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _INT]
    lib.l3_uniform_noise.restype = None
    return lib


def uniform_noise(lib: ctypes.CDLL, keys: torch.Tensor, counters: torch.Tensor,
                  vocab_keys: torch.Tensor) -> torch.Tensor:
    """[N, V] float32 in (0, 1) from int64 keys [N], counters [N] and vocab_keys [V] on the cpu."""
    keys, counters, vocab_keys = (t.to(torch.int64).contiguous() for t in (keys, counters, vocab_keys))
    out = torch.empty(keys.shape[0], vocab_keys.shape[0], dtype=torch.float32)
    lib.l3_uniform_noise(keys.data_ptr(), counters.data_ptr(), vocab_keys.data_ptr(), keys.shape[0],
                         vocab_keys.shape[0], out.data_ptr(), torch.get_num_threads())
    return out


def check_error(lib: ctypes.CDLL) -> float:
    """0.0 where the kernel gives the torch version's bits (keys at the ends of their range,
    counters past 2^32, an odd vocabulary, tokens whose hash is the largest there is), else inf."""
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor([0, (1 << 32) - 1]), torch.randint(0, 1 << 32, (5,), generator=g)])
    counters = torch.cat([torch.tensor([(1 << 40) + 7, 0]), torch.randint(0, 1 << 20, (5,), generator=g)])
    row = hash32(int(keys[0]) ^ (int(counters[0]) & M32))
    top = torch.tensor([unhash32(M32) ^ row, unhash32(M32 - 255) ^ row, unhash32(M32 - 256) ^ row])
    vocab = torch.cat([vocab_hash(1001, torch.device("cpu")), top])
    same = torch.equal(uniform_noise(lib, keys, counters, vocab), torch_uniform_noise(keys, counters, vocab))
    return 0.0 if same else float("inf")


KERNEL = CheckedKernel("cpu_sampling_noise", "sampling_noise.cpp", "the sampling noise is hashed by torch ops",
                       _bind, check_error, 0.0, cpu_flags=("avx2",), compile_flags=COMPILE_FLAGS)
