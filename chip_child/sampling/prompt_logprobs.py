"""Prompt log-probabilities (SamplingParams.prompt_logprobs): of each next prompt token and the
most likely ones, at a chunk's positions, a bounded number of positions at a time."""
from __future__ import annotations

import torch

from chip_child.models.qwen3 import LayerOps, Qwen3Weights, final_logits

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose [rows, vocab] logits exist at once


def prompt_logprobs(weights: Qwen3Weights, ops: LayerOps, hidden: torch.Tensor, targets: torch.Tensor, first: int,
                    top: int, values: torch.Tensor, top_ids: torch.Tensor) -> None:
    """Log-probabilities of the raw logits at `hidden`'s positions, of each next prompt token
    (`targets`) and the `top` most likely, into rows first.. of `values` / `top_ids`."""
    for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        z = min(a + PROMPT_LOGPROB_ROWS, len(targets))
        logprobs = final_logits(weights, hidden[a:z], ops=ops).log_softmax(dim=-1)
        values[first + a:first + z, 0] = logprobs.gather(1, targets[a:z, None]).squeeze(1)
        if top:
            best = logprobs.topk(top, dim=-1)
            values[first + a:first + z, 1:1 + top] = best.values
            top_ids[first + a:first + z, :top] = best.indices
