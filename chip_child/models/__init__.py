"""Model code: Qwen3 and its families as plain functions, MoE, FP8, fused kernels, the checkpoint
loader and the built-in model. May import attention/ and device; never step/."""
