"""Host buffers shared by the parent and its chip-children.

Made with `share_memory_()` before any child starts. torch backs them with an already-unlinked
shared-memory file, so nothing is left in /dev/shm whatever way the processes end; children map
the same memory from the inherited file descriptor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from l3worker.params import MAX_LOGPROBS


@dataclass(frozen=True)
class BufferSpec:
    """How a child maps a shared tensor: the descriptor it inherits, and the tensor's layout."""

    fd: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> list:
        return [self.fd, self.nbytes, list(self.shape), self.dtype]


def make_shared(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, BufferSpec]:
    tensor = torch.zeros(shape, dtype=dtype).share_memory_()
    fd, nbytes = tensor.untyped_storage()._share_fd_cpu_()
    os.set_inheritable(fd, True)
    return tensor, BufferSpec(fd, nbytes, tuple(shape), str(dtype).removeprefix("torch."))


@dataclass
class StepBuffers:
    """Ring slot s serves step s % slots: sampled ids and the step's figures out, prompt ids in.
    A slot is reused only after its step completed, since at most `pipeline_depth` < `slots`
    steps are in flight. The doorbell says which steps completed (see l3worker.worker.doorbell).

    Log-probabilities (K = MAX_LOGPROBS) are written only on steps that asked for them: the
    per-row ones when an active row has logprobs >= 0 (a prefill step writes its admitted rows),
    the prompt ones when an admit has prompt_logprobs >= 0. Entries beyond a row's N are
    unspecified, as is everything a step did not write."""

    sampled: torch.Tensor  # int32 [slots, max_batch_size]
    staging: torch.Tensor  # int32 [slots, prefill_capacity]
    step_stats: torch.Tensor  # int64 [slots, 5]: apply_us, device_us, h2d_copies, h2d_bytes, pool_allocs
    doorbell: torch.Tensor  # int64 [3]: steps completed, step the parent sleeps on (-1: none), error sent
    # float32 [slots, max_batch_size, 1 + K]: [..., 0] the sampled token's logprob, [..., 1:1+N] the top N
    logprobs: torch.Tensor
    logprob_ids: torch.Tensor  # int32 [slots, max_batch_size, K]: the top N ids, most likely first
    # float32 [slots, prefill_capacity, 1 + K]: entry staging_offset + j - 1 holds prompt token j's
    # logprob given tokens 0..j-1 and the top N at that position (j = 1..prompt_len-1)
    prompt_logprobs: torch.Tensor
    prompt_logprob_ids: torch.Tensor  # int32 [slots, prefill_capacity, K]
    specs: dict[str, BufferSpec]
    # Speculative decoding with k drafts (else None): int32 [slots, max_batch_size, 2], each row's
    # tokens produced and drafts verified, and int32 [slots, max_batch_size, k + 1] those tokens;
    # float32 [slots, max_batch_size, k, 1 + K] and int32 [slots, max_batch_size, k, K] the
    # log-probabilities of tokens 1..k (token 0's in `logprobs` / `logprob_ids`, as a plain step's),
    # written on steps where a row asking for them verified drafts.
    spec_counts: torch.Tensor | None = None
    spec_ids: torch.Tensor | None = None
    spec_logprobs: torch.Tensor | None = None
    spec_logprob_ids: torch.Tensor | None = None

    @classmethod
    def create(cls, slots: int, max_batch_size: int, prefill_capacity: int,
               speculative_tokens: int = 0) -> "StepBuffers":
        k = MAX_LOGPROBS
        shapes = {"sampled": ((slots, max_batch_size), torch.int32),
                  "staging": ((slots, prefill_capacity), torch.int32),
                  "step_stats": ((slots, 5), torch.int64), "doorbell": ((3,), torch.int64),
                  "logprobs": ((slots, max_batch_size, 1 + k), torch.float32),
                  "logprob_ids": ((slots, max_batch_size, k), torch.int32),
                  "prompt_logprobs": ((slots, prefill_capacity, 1 + k), torch.float32),
                  "prompt_logprob_ids": ((slots, prefill_capacity, k), torch.int32)}
        if speculative_tokens:
            shapes["spec_counts"] = ((slots, max_batch_size, 2), torch.int32)
            shapes["spec_ids"] = ((slots, max_batch_size, speculative_tokens + 1), torch.int32)
            shapes["spec_logprobs"] = ((slots, max_batch_size, speculative_tokens, 1 + k), torch.float32)
            shapes["spec_logprob_ids"] = ((slots, max_batch_size, speculative_tokens, k), torch.int32)
        made = {name: make_shared(shape, dtype) for name, (shape, dtype) in shapes.items()}
        made["doorbell"][0][1] = -1
        return cls(**{name: tensor for name, (tensor, _) in made.items()},
                   specs={name: spec for name, (_, spec) in made.items()})

    @property
    def slots(self) -> int:
        return self.sampled.shape[0]

    @property
    def fds(self) -> list[int]:
        return [s.fd for s in self.specs.values()]
