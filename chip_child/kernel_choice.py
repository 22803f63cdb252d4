"""Which kernels the user forced back to their torch reference.

`L3WORKER_REFERENCE_KERNELS=add_rms_norm,qk_norm_rope,...` (any of KERNELS, or `all`) makes those
kernels' callers run the reference without checking the kernel; an unknown name is a ValueError."""
from __future__ import annotations

import os

# Fused model ops (chip_child.models.kernel_checks), the attention backend
# (chip_child.attention.self_check) and the cpu kernels (chip_child.cpu_kernels).
KERNELS = ("add_rms_norm", "qk_norm_rope", "silu_mul", "moe", "fp8_gemm", "attention", "cpu_bf16_linear",
           "cpu_bf16_linear_avx2", "cpu_bf16_amx", "cpu_decode_attention", "cpu_decode_attention_avx2",
           "cpu_layer_ops", "cpu_layer_ops_avx2", "cpu_sampling_noise", "cpu_decode_layers",
           "cpu_step_team", "cpu_decode_head")


def forced_reference() -> set[str]:
    names = {n.strip() for n in os.environ.get("L3WORKER_REFERENCE_KERNELS", "").split(",") if n.strip()}
    unknown = names - set(KERNELS) - {"all"}
    if unknown:
        raise ValueError(f"L3WORKER_REFERENCE_KERNELS: unknown kernel(s) {sorted(unknown)}; the kernels are "
                         f"{', '.join(KERNELS)} (or all)")
    return set(KERNELS) if "all" in names else names
