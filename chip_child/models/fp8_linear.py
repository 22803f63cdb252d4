"""Block-FP8 linear layers kept as stored (no dequantized copy): W8A8 on cuda.

Where the loader keeps a projection's float8_e4m3fn weight and its per-block scales
(`keeps_fp8`: cuda with fp8 tensor cores, with L3WORKER_FP8_W8A8=1), the model holds an `Fp8Linear`, called like any of
model.linear's weights: `layer(x, bias)`. A call quantizes the activations per token and group of
block[1] columns (dynamic scales, chip_child.models.fp8_kernels.group_quant_kernel), then runs one
block-scaled GEMM with fp32 accumulation:

- "scaled_mm": torch's F.scaled_mm with the BlockWise1x128 x BlockWise128x128 recipe (cuBLAS,
  Hopper, CUDA 12.9+), chosen only for 128 x 128 blocks and shapes cuBLAS takes, and only after a
  probe on this device agreed with the reference;
- "triton": our block_fp8_gemm_kernel, any power-of-two block width >= 16 (also the cpu under
  TRITON_INTERPRET=1, where the tests run it);
- "torch": `reference_linear`, the same math in fp32 torch ops (a cpu without the interpreter).

Every other device dequantizes per block at load (chip_child.models.fp8) and never sees this class. A MoE
layer's experts kept as fp8 are chip_child.models.fp8_experts'.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from chip_child.models.fp8 import FP8, FP8_MAX, SCALE_SUFFIX, _per_element, dequantize_blocks, quantize_blocks
from chip_child.models.quant import BlockFp8

EPS = 1e-10  # fp8_kernels.EPS (not imported from there: that imports triton): the floor of a group's scale
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores (Ada, Hopper and later); Triton has no e4m3 dot below
SCALED_MM_BLOCK = (128, 128)  # the only weight block cuBLAS's blockwise recipe takes


def keeps_fp8(device_type: str, quant: BlockFp8 | None, capability: tuple[int, int] | None) -> bool:
    """Whether the loader keeps block-FP8 projections as fp8 + scales (else dequantizes them):
    on cuda with fp8 tensor cores, for blocks whose width the GEMM can step by (a power of two
    of at least 16 columns: tl.dot's smallest K and tl.arange's shape rule)."""
    if device_type != "cuda" or quant is None or capability is None or tuple(capability) < MIN_CAPABILITY:
        return False
    cols = quant.block[1]
    return cols >= 16 and cols & (cols - 1) == 0


# Opt-in: on an H200 (2026-11-27) W8A8 matched its reference (each GEMM within the fp8 tensor cores'
# accumulation, a whole model's logits within the flips of activation rounding) but decoded the
# Qwen3-0.6B shape 1.14x (batch 1) and 1.25x (batch 64) slower than the dequantized bf16 weights
# (scripts/bench_fp8.py). It saves weight memory; the dequantized default is faster and exact.
W8A8_ENV = "L3WORKER_FP8_W8A8"


def keeps_fp8_on(device: torch.device, quant: BlockFp8 | None) -> bool:
    """keeps_fp8 for a resolved device (asks cuda for its capability only on cuda), when
    L3WORKER_FP8_W8A8=1 asks for it; otherwise says on stderr that the weights are dequantized."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if not keeps_fp8(device.type, quant, capability):
        return False
    if os.environ.get(W8A8_ENV) == "1":
        return True
    print(f"chip-child: block-FP8 weights are dequantized at load on {device} (faster than W8A8 where measured; "
          f"{W8A8_ENV}=1 keeps them fp8, half the weight memory)", file=sys.stderr, flush=True)
    return False


# -- the math ---------------------------------------------------------------------------------------

def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of group_quant_kernel: x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, ceil(K / group)])."""
    m, k = x.shape
    groups = -(-k // group)
    pad = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    pad[:, :k] = x.float()
    scale = pad.view(m, groups, group).abs().amax(-1).clamp(min=EPS) / FP8_MAX
    q = (pad.view(m, groups, group) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     out_dtype: torch.dtype) -> torch.Tensor:
    """What the kernels compute, in fp32 torch ops: x quantized per group, times the weight
    dequantized per block, transposed."""
    q, scale = quantize_groups(x, block[1])
    a = q.float() * _per_element(scale, q.shape, (1, block[1]))
    return (a @ dequantize_blocks(weight, scale_inv, block, torch.float32).t()).to(out_dtype)


def quantize_activations(x: torch.Tensor, group: int, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """group_quant_kernel: (q [M, K], scales [M, ceil(K / group)]); `column_major` lays the scales
    out as cuBLAS's 1x128 recipe reads them (stride [1, M])."""
    from chip_child.models import fp8_kernels as k

    m, cols = x.shape
    groups = -(-cols // group)
    q = torch.empty((m, cols), dtype=FP8, device=x.device)
    scale = (torch.empty((groups, m), dtype=torch.float32, device=x.device).t() if column_major else
             torch.empty((m, groups), dtype=torch.float32, device=x.device))
    k.group_quant_kernel[(m, groups)](x, q, scale, cols, x.stride(0), q.stride(0), *scale.stride(), GROUP=group)
    return q, scale


def triton_gemm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    from chip_child.models import fp8_kernels as k

    m, cols = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    # Decode's few rows: narrower column tiles give more programs to read the weight with.
    block_m, block_n = (16, 64) if m <= 16 else (32, 128) if m <= 32 else (64, 128)
    k.block_fp8_gemm_kernel[(-(-m // block_m), -(-n // block_n))](
        q, scale, weight, scale_inv, out, m, n, cols, q.stride(0), *scale.stride(), weight.stride(0),
        *scale_inv.stride(), out.stride(0), GROUP_N=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1])
    return out


def _scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, scale_inv_t: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    import torch.nn.functional as F

    recipe = F.ScalingType
    return F.scaled_mm(q, weight.t(), scale, recipe.BlockWise1x128, scale_inv_t, recipe.BlockWise128x128,
                       output_dtype=out_dtype)


def scaled_mm_takes(shape: tuple[int, int], block: tuple[int, int]) -> bool:
    """cuBLAS's blockwise recipe: 128 x 128 weight blocks, whole blocks, and a count of K blocks
    that is a multiple of 4 (its weight scales are read with K padded to 4 blocks)."""
    n, k = shape
    return tuple(block) == SCALED_MM_BLOCK and n % 128 == 0 and k % 512 == 0


@lru_cache(maxsize=None)
def scaled_mm_works(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether F.scaled_mm's blockwise recipe runs here and agrees with reference_linear: probed
    once per device and output dtype, at several row counts (decode's few rows included). Each
    weight block and activation group has its own power-of-two magnitude, so a scale read from
    the wrong block is off by 2x or more, far outside the tolerance."""
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return False
    g = torch.Generator().manual_seed(0)
    n_blocks, k_blocks = 2, 4
    magnitude = 2.0 ** (torch.arange(k_blocks) + 2 * torch.arange(n_blocks)[:, None])
    shape = (128 * n_blocks, 128 * k_blocks)
    w = torch.randn(shape, generator=g) * _per_element(magnitude, shape, SCALED_MM_BLOCK)
    weight, scale_inv = (t.to(device) for t in quantize_blocks(w, SCALED_MM_BLOCK))
    for m in (1, 5, 64):
        spread = _per_element(2.0 ** -torch.arange(k_blocks)[None], (m, shape[1]), (1, 128))
        x = (torch.randn(m, shape[1], generator=g) * spread).to(device)
        try:
            q, scale = quantize_activations(x, 128, column_major=True)
            got = _scaled_mm(q, scale, weight, scale_inv.t(), out_dtype).float()
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            return False
        want = reference_linear(x, weight, scale_inv, SCALED_MM_BLOCK, torch.float32)
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()):
            return False
    return True


def choose_gemm(device: torch.device, shape: tuple[int, int], block: tuple[int, int], out_dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "scaled_mm" if scaled_mm_takes(shape, block) and scaled_mm_works(device, out_dtype) else "triton"
    return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"


@dataclass
class Fp8Linear:
    """y = x @ W^T (+ bias) with W float8_e4m3fn [out, in] as stored (K-major, as both GEMMs read
    it) and one fp32 scale per block. `gemm` is chosen for the device by `to`."""

    weight: torch.Tensor
    scale_inv: torch.Tensor  # [ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    out_dtype: torch.dtype  # the model's compute dtype
    gemm: str = "torch"

    def to(self, device: torch.device | str) -> "Fp8Linear":
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        weight, scale_inv = self.weight.to(device), self.scale_inv.to(device)
        gemm = choose_gemm(device, tuple(weight.shape), self.block, self.out_dtype)
        return replace(self, weight=weight, scale_inv=scale_inv, gemm=gemm)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemm == "torch" or x.shape[0] == 0:
            y = reference_linear(x, self.weight, self.scale_inv, self.block, self.out_dtype)
        elif self.gemm == "scaled_mm":
            q, scale = quantize_activations(x, self.block[1], column_major=True)
            # cuBLAS reads the weight scales transposed: [K blocks, N blocks], stride [1, K blocks]
            y = _scaled_mm(q, scale, self.weight, self.scale_inv.t(), self.out_dtype)
        else:
            q, scale = quantize_activations(x, self.block[1])
            y = triton_gemm(q, scale, self.weight, self.scale_inv, self.block, self.out_dtype)
        return y if bias is None else y + bias


# -- building the model's projections -----------------------------------------------------------------

Part = tuple[str, slice, slice]  # a checkpoint tensor's name, its rows (output) and columns (input) taken


def _aligned(s: slice, size: int, block: int, last: bool) -> bool:
    start, stop, _ = s.indices(size)
    return start % block == 0 and (stop % block == 0 or (stop == size and last))


def _fp8_parts(state: dict[str, torch.Tensor], parts: list[Part], quant: BlockFp8, dtype: torch.dtype):
    """Fp8Linear of the parts stacked by rows, when every part is kept as fp8 and its slices fall
    on block edges; otherwise None."""
    if not all(name + SCALE_SUFFIX in state for name, _, _ in parts):
        return None
    rows_b, cols_b = quant.block
    weights, scales = [], []
    for i, (name, rows, cols) in enumerate(parts):
        w, s = state[name], state[name + SCALE_SUFFIX]
        if not (_aligned(rows, w.shape[0], rows_b, i == len(parts) - 1) and _aligned(cols, w.shape[1], cols_b, True)):
            return None
        r0, r1, _ = rows.indices(w.shape[0])
        c0, c1, _ = cols.indices(w.shape[1])
        weights.append(w[rows, cols])
        scales.append(s[r0 // rows_b: -(-r1 // rows_b), c0 // cols_b: -(-c1 // cols_b)])
    return Fp8Linear(torch.cat(weights), torch.cat(scales).contiguous(), quant.block, dtype)


def projection(state: dict[str, torch.Tensor], parts: list[Part], quant: BlockFp8 | None,
               dtype: torch.dtype) -> "torch.Tensor | Fp8Linear":
    """The [in, out] weight of `parts` stacked by rows (q/k/v, gate/up, or one tensor's shard):
    an Fp8Linear where the loader kept them as fp8 and the slices fall on block edges, else a
    plain transposed view (fp8 parts dequantized per block into `dtype`)."""
    if quant is not None:
        fused = _fp8_parts(state, parts, quant, dtype)
        if fused is not None:
            return fused

    def plain(name: str) -> torch.Tensor:
        w = state[name]
        return dequantize_blocks(w, state[name + SCALE_SUFFIX], quant.block, dtype) if w.dtype == FP8 else w

    pieces = [plain(name)[rows, cols] for name, rows, cols in parts]
    return (torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()).t()
