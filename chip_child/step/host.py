"""What the runtime hands its proposers and warm-up: the slice of ChipRuntime they use, as a
Protocol, so they depend on this interface and not on the runtime (which imports them)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from chip_child.attention import AttentionBackend
    from chip_child.config import RuntimeConfig
    from chip_child.models.loader import ModelConfig
    from chip_child.models.qwen3 import LayerOps, Qwen3Weights
    from chip_child.protocol import Command
    from chip_child.step.results import StepOutputs
    from chip_child.step.row_state import RowState


class StepHost(Protocol):
    cfg: RuntimeConfig
    device: torch.device
    dtype: torch.dtype
    model_cfg: ModelConfig  # this rank's shard
    weights: Qwen3Weights
    ops: LayerOps
    attn: AttentionBackend
    rope: torch.Tensor
    state: dict[str, torch.Tensor]  # the decode step's pooled tensors, by slot
    prefill_state: dict[str, torch.Tensor]
    rows: RowState
    lane_views: dict[int, dict[str, torch.Tensor]]  # each lane bucket's views of `state`
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    def h2d(self, arr: np.ndarray) -> torch.Tensor: ...

    def grammar_masks(self, v: dict[str, torch.Tensor], lanes: int) -> None: ...

    def register_callable(self, name: str, fn: Callable) -> None: ...

    def execute(self, cmd: Command, staging: np.ndarray, out: torch.Tensor,
                outputs: StepOutputs | None = None): ...

    def finish_rows(self, rows: list[int]) -> None: ...

    def reset(self) -> None: ...
