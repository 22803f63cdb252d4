"""The step's pooled tensors, declared once: the decode step's and the prefill step's task arguments
(slot, shape, dtype, role), and the per-row slots a step reads narrowed to its lanes."""
from __future__ import annotations

import torch

from chip_child.attention import AttentionBackend
from chip_child.step.chunk_layout import ChunkLayout
from chip_child.step.pool import TaskArg
from chip_child.step.row_fields import DEVICE_FIELDS, MAX_LOGPROBS
from chip_child.step.row_state import row_slots

STATE = "state"  # pool owner of the tensors prefill and decode share
# Pooled tensors with one entry per row: a step reads them narrowed to its lanes.
LANE_SLOTS = ("input_ids", "positions", "active", "block_table", "slot_mapping", "lane_seq_lens", "logits",
              *(f.array for f in DEVICE_FIELDS), "min_pos", "output_counts", "prompt_seen", "stop_mask", "grammar_mask",
              "lp_values", "lp_ids")


def step_task_args(attn: AttentionBackend, kv_dtype: torch.dtype, b: int, mb: int, v: int,
                   p: int) -> tuple[tuple[TaskArg, ...], tuple[TaskArg, ...]]:
    """The decode step's and the prefill step's pooled tensors (the prefill's: the decode's
    and the packed axis's), for `b` rows of `mb` blocks, vocabulary `v`, `p` chunk tokens."""
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    state = lambda slot, shape, dtype, role: TaskArg(slot, shape, dtype, role, owner=STATE)  # noqa: E731
    shared = (
        state("kv_cache", attn.kv_cache_shape, kv_dtype, "inout"),
        *(state(f"attn_{name}", shape, dtype, "inout") for name, (shape, dtype) in
          attn.workspace_shapes.items()),
        state("input_ids", (b,), i64, "inout"),
        *(state(*spec) for spec in row_slots(b, v, mb)),
        state("lane_seq_lens", (b,), i32, "inout"),
        state("lane_starts", (b + 1,), i32, "in"),
        state("vocab_keys", (v,), i64, "in"),
        state("logits", (b, v), f32, "out"),
        state("lp_values", (b, 1 + MAX_LOGPROBS), f32, "out"),
        state("lp_ids", (b, MAX_LOGPROBS), i64, "out"),
    )
    return shared, shared + (
        # [lanes | chunk tokens] on the packed axis; the host fills the chunk part in one copy.
        TaskArg("tokens", (b + p,), i64, "in"),
        TaskArg("token_positions", (b + p,), i64, "in"),
        TaskArg("token_slots", (b + p,), i64, "inout"),
        TaskArg("chunk_ints", (ChunkLayout.capacity(b, p),), i64, "in"),
        TaskArg("prompt_lp_values", (p, 1 + MAX_LOGPROBS), f32, "out"),
        TaskArg("prompt_lp_ids", (p, MAX_LOGPROBS), i64, "out"),
    )
