"""Block FP8 weights (quant.BlockFp8): dequantized per block at load into the compute dtype.

Each (rows x cols) block of a float8_e4m3fn matrix has one float32 scale in `<name>_scale_inv`
([ceil(out / rows), ceil(in / cols)]); the weight is fp8 * scale. The product of an fp8 value
(4 significant bits) and an fp32 scale is exact in fp32, so dequantizing to fp32 loses nothing and
to bf16/fp16 rounds once, as a dequantized reference would. `quantize_blocks` is the inverse
(per block amax / 448): `quantization="fp8"` runs both on a plain checkpoint's projections at load
(`round_trip`), so it computes with exactly the weights its FP8 checkpoint would hold.
"""
from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def is_quantized_at_load(name: str) -> bool:
    """The weights quantization="fp8" quantizes: the linear layers' (attention, MLP and expert
    projections), as the Qwen3-*-FP8 releases do; the embedding, lm_head, norms and the MoE
    router stay plain."""
    return name.endswith("_proj.weight")


def _per_element(scale_inv: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] fp32: each block's scale repeated over its elements (ragged edge blocks cut)."""
    rows, cols = block
    return scale_inv.float().repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """float8 [out, in] with scales [ceil(out / rows), ceil(in / cols)] -> `dtype` [out, in]."""
    want = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if weight.dtype != FP8 or weight.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(f"block fp8: expected a float8_e4m3fn matrix and scales of shape {list(want)}, got "
                         f"{weight.dtype} {list(weight.shape)} and {list(scale_inv.shape)}")
    return (weight.float() * _per_element(scale_inv, weight.shape, block)).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], fp32 scale_inv per block): each block scaled so its
    largest magnitude maps to 448."""
    rows, cols = block
    out, inp = weight.shape
    pad = torch.zeros(-(-out // rows) * rows, -(-inp // cols) * cols, dtype=torch.float32)
    pad[:out, :inp] = weight.float()
    blocks = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (pad / _per_element(scale_inv, pad.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q[:out, :inp].contiguous(), scale_inv


def round_trip(weight: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`weight` quantized per block and dequantized into `dtype`: what its FP8 checkpoint loads as."""
    return dequantize_blocks(*quantize_blocks(weight, block), block, dtype)
