"""Per-step and per-request figures the worker reports through stats() and --profile."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class StepRecord:
    step: int
    prefill: bool
    parent_wall_s: float  # since the previous step completed: the step period the parent sees
    wait_s: float  # waiting for the child to finish the step (doorbell spin or sleep)
    apply_s: float  # child: applying the command, running the step, copying the ids out
    device_s: float  # child: device time of the step
    command_bytes: int
    h2d_copies: int
    h2d_bytes: int
    pool_allocs: int
    prefill_tokens: int = 0  # prompt tokens the step's chunks computed
    rows: int = 0  # rows that sampled a token in the step (decoding rows and last chunks)
    preemptions: int = 0  # the scheduler's preemptions so far (cumulative)

    @classmethod
    def of(cls, step: int, prefill: bool, child_stats: list, parent_wall_s: float, wait_s: float, command_bytes: int,
           prefill_tokens: int, rows: int, preemptions: int) -> "StepRecord":
        """From the child's figures of the step (the ring's step_stats row: apply and device
        microseconds, host-to-device copies and bytes, pool allocations) and the parent's."""
        apply_us, device_us, h2d_copies, h2d_bytes, pool_allocs = child_stats
        return cls(step, prefill, parent_wall_s, wait_s, apply_us / 1e6, device_us / 1e6, command_bytes,
                   int(h2d_copies), int(h2d_bytes), int(pool_allocs), prefill_tokens, rows, preemptions)


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


@dataclass
class GenerateStats:
    """One generate() call. Cleared at the next call, so memory stays flat on a long-lived worker."""

    started_at: float = 0.0  # perf_counter() when the call began
    setup_s: float = 0.0
    wall_s: float = 0.0
    requests: int = 0
    generated_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def summary(self) -> dict:
        decode = [s for s in self.steps if not s.prefill]
        prefill = [s for s in self.steps if s.prefill]
        per_step = {
            name: distribution([getattr(s, name) for s in decode])
            for name in ("parent_wall_s", "wait_s", "apply_s", "device_s", "command_bytes", "h2d_copies",
                         "h2d_bytes", "pool_allocs")
        }
        decode_wall = sum(s.parent_wall_s for s in decode)
        return {
            "setup_s": self.setup_s,
            "wall_s": self.wall_s,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "prefill_steps": len(prefill),
            "prefill_s": sum(s.parent_wall_s for s in prefill),
            "decode_steps": len(decode),
            "decode_s": decode_wall,
            "ttft_s": distribution(self.ttft_s),
            "tpot_s": distribution(self.tpot_s),
            "decode_step": per_step,
            "max_command_bytes": max((s.command_bytes for s in decode), default=0),
            "pool_allocs_total": sum(s.pool_allocs for s in self.steps),
        }

    def step_table(self) -> list[dict]:
        return [asdict(s) for s in self.steps]


def advance_bar(bar, finals, elapsed_s: float) -> None:
    """generate()'s progress bar (tqdm): one more request done, with the token rates so far."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    output_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    bar.set_postfix_str(f"input {prompt_tokens / elapsed_s:.1f} tok/s, output {output_tokens / elapsed_s:.1f} tok/s",
                        refresh=False)
    bar.update(1)
