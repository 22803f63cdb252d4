"""Block-FP8 MoE experts kept as stored (no dequantized copy): W8A8 in our fused MoE on cuda.

Where the loader kept the experts' fp8 tensors (fp8_linear.keeps_fp8: cuda with fp8 tensor cores),
a sparse layer's gate_up and down are `Fp8Experts`: each local expert's float8_e4m3fn matrix as
stored, [experts, out, in] (K-major), with its fp32 block scales [experts, out blocks, in blocks].
The fused MoE (chip_child.models.moe_triton) quantizes its activations per token and group of block[1]
columns (fp8_kernels' quantizer) and applies each expert block's scale per K step inside its K loop,
accumulating in fp32: the semantics of vLLM's fused_moe with use_fp8_w8a8 and block_shape.
`Fp8Experts.mm` is the same math per expert in torch ops (fp8_linear.reference_linear), what
torch_moe runs.

A tensor-parallel shard of the intermediate dimension that cuts the blocks (a shard size that is not
a multiple of the block's rows for gate/up, of its columns for down) cannot keep them: that
projection's experts are dequantized at load into the compute dtype, as fp8_linear.projection does
for dense layers (memory as the dequantized load's for that projection).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from chip_child.models.fp8 import dequantize_blocks
from chip_child.models.fp8_linear import Fp8Linear, Part, projection, reference_linear
from chip_child.models.quant import BlockFp8


@dataclass
class Fp8Experts:
    weight: torch.Tensor  # float8_e4m3fn [experts, out, in]
    scale_inv: torch.Tensor  # fp32 [experts, ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    out_dtype: torch.dtype  # the model's compute dtype

    @property
    def shape(self) -> torch.Size:
        """[experts, in, out]: a plain expert stack's shape (MoeWeights and the MoE read it)."""
        e, n, k = self.weight.shape
        return torch.Size((e, k, n))

    def __getitem__(self, experts: slice) -> "Fp8Experts":
        return replace(self, weight=self.weight[experts], scale_inv=self.scale_inv[experts])

    def to(self, device: torch.device | str) -> "Fp8Experts":
        return replace(self, weight=self.weight.to(device), scale_inv=self.scale_inv.to(device))

    def mm(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x @ one expert's weight in the W8A8 reference math (x quantized per group, fp32)."""
        return reference_linear(x, self.weight[expert], self.scale_inv[expert], self.block, self.out_dtype)


def expert_stack(state: dict[str, torch.Tensor], parts: list[list[Part]], quant: BlockFp8 | None,
                 dtype: torch.dtype) -> "torch.Tensor | Fp8Experts":
    """One projection of every local expert (`parts[e]`: expert e's parts, stacked by rows as in
    fp8_linear.projection): Fp8Experts where the loader kept them as fp8 and the slices fall on
    block edges, else a plain [experts, in, out] stack (fp8 dequantized per block into `dtype`)."""
    pieces = [projection(state, p, quant, dtype) for p in parts]
    if pieces and all(isinstance(p, Fp8Linear) for p in pieces):
        return Fp8Experts(torch.stack([p.weight for p in pieces]), torch.stack([p.scale_inv for p in pieces]),
                          quant.block, dtype)
    # Every expert has the same shapes and slices, so all or none are fp8; dequantize any regardless.
    return torch.stack([dequantize_blocks(p.weight, p.scale_inv, p.block, dtype).t() if isinstance(p, Fp8Linear)
                        else p for p in pieces])
