"""What a step gives back: the host views its log-probabilities go to, its record, and a step
launched but not yet completed (chip_child.step.runtime.ChipRuntime.launch / complete)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chip_child.device import DeviceTimer
from chip_child.step.row_fields import MAX_LOGPROBS


@dataclass
class StepOutputs:
    """Host views a step's log-probabilities are written into (a ring slot's, in a chip-child);
    K = MAX_LOGPROBS. Written only when some row of the step asked: `logprobs` [B, 1 + K]
    ([:, 0] the sampled token's, [:, 1:1+N] the top N) with `logprob_ids` [B, K]; and
    `prompt_logprobs` [P, 1 + K] with `prompt_logprob_ids` [P, K], where entry staging_offset + j - 1
    is prompt token j's, given tokens 0..j-1, and the top N there (j = 1..prompt_len-1)."""

    logprobs: torch.Tensor  # float32 [max_batch_size, 1 + K]
    logprob_ids: torch.Tensor  # int32 [max_batch_size, K]
    prompt_logprobs: torch.Tensor  # float32 [prefill_capacity, 1 + K]
    prompt_logprob_ids: torch.Tensor  # int32 [prefill_capacity, K]
    # Speculative decoding (chip_child.spec.speculation), else None: per row, the tokens the step
    # produced and the drafts it verified (int32 [max_batch_size, 2]), and those tokens in order
    # (int32 [max_batch_size, k + 1]; sampled ids hold the last); the log-probabilities of tokens
    # 1..k, as `logprobs` / `logprob_ids` hold token 0's (float32 [max_batch_size, k, 1 + K],
    # int32 [max_batch_size, k, K]), written when a row asking for them verified drafts.
    spec_counts: torch.Tensor | None = None
    spec_ids: torch.Tensor | None = None
    spec_logprobs: torch.Tensor | None = None
    spec_logprob_ids: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_batch_size: int, prefill_capacity: int) -> "StepOutputs":
        k = MAX_LOGPROBS
        return cls(torch.zeros(max_batch_size, 1 + k), torch.zeros(max_batch_size, k, dtype=torch.int32),
                   torch.zeros(prefill_capacity, 1 + k), torch.zeros(prefill_capacity, k, dtype=torch.int32))


@dataclass
class StepResult:
    apply_s: float
    device_s: float
    h2d_copies: int
    h2d_bytes: int
    pool_allocs: int
    logprobs: int = -1  # N of the per-row log-probabilities written into the outputs; -1: none
    prompt_logprobs: bool = False  # prompt log-probabilities were written


@dataclass
class LaunchedStep:
    """A step whose work is queued (ChipRuntime.launch) and not yet completed."""

    result: StepResult
    out: torch.Tensor
    lanes: int
    ids_host: torch.Tensor | None  # pinned host copy of the sampled ids, once `done` fired; None on the cpu
    done: object | None  # the device event after that copy
    timer: DeviceTimer
