"""How many prompt tokens a step that also decodes may carry, from how long steps took.

A step's prompt chunk delays every decoding row's next token by its own compute time. Counted in
tokens alone (`max_num_batched_tokens`), one step could carry a whole wave of new prompts and take
several decode steps' time, which every streaming client sees as a stall. So the step loop feeds
each finished step's child time here, and the scheduler caps a decoding step's prompt tokens at
what fits in about one decode step's time (`decode_s * PREFILL_TIME_RATIO`): no decoding row waits
much more than one decode step plus one such chunk. A step without decoding rows (an idle
engine's first prompts) still takes the whole token budget, so a lone request's TTFT is unchanged,
and so does a burst, more prompts starting than rows decoding (Scheduler._whole_budget).

Estimates are moving averages: a decode-only step's time, and a prompt token's, from steps with
prompt tokens (without decoding rows: the step's time over its tokens; with them: the time
beyond a decode step's). Until both exist there is no cap.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# A decoding step's prompt chunk may take about this many decode steps' time; 0 turns the cap off
# (the token budget alone, as before), for comparisons.
PREFILL_TIME_RATIO = float(os.environ.get("L3WORKER_PREFILL_TIME_RATIO", "1.0"))
MIN_CHUNK_TOKENS = 32  # the cap never goes below this: prompts still move on when tokens are costly
SMOOTHING = 0.2  # weight of the newest step in the moving averages


@dataclass
class StepTiming:
    decode_s: float | None = None  # a decode-only step's child time
    token_s: float | None = None  # the child time a prompt token adds to a step

    def observe(self, child_s: float, prompt_tokens: int, decode_rows: int) -> None:
        """One finished step: its child time, prompt tokens and rows that decoded."""
        if child_s <= 0:
            return
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, child_s)
        elif decode_rows == 0:
            self.token_s = _average(self.token_s, child_s / prompt_tokens)
        elif self.decode_s is not None:
            self.token_s = _average(self.token_s, max(child_s - self.decode_s, 0.0) / prompt_tokens)

    def prefill_cap(self) -> int | None:
        """Prompt tokens a step with decoding rows may carry; None: no estimate yet (no cap)."""
        if self.decode_s is None or not self.token_s or PREFILL_TIME_RATIO <= 0:
            return None
        return max(MIN_CHUNK_TOKENS, int(self.decode_s * PREFILL_TIME_RATIO / self.token_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
