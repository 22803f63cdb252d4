"""One sample of a request as the scheduler keeps it (l3worker.engine.scheduler): its ids, pages,
row, progress and options."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from chip_child.step.row_fields import row_values
from l3worker.engine.page_pool import CacheCursor
from l3worker.params import SamplingParams
from l3worker.structured.request_grammars import SampleGrammar

if TYPE_CHECKING:
    from l3worker.lora.registry import Registered


@dataclass(eq=False)  # compared by identity: a field-wise == would compare id arrays
class Sequence:
    """One sample of a request: it occupies one batch row while it runs."""

    seq_id: int
    index: int  # which of the request's n samples
    prompt_ids: np.ndarray  # int32
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    arrival: float = field(default_factory=time.perf_counter)
    want_prompt_logprobs: bool = False  # sample 0 of a request that asked for them
    request_id: str = ""
    row: int = -1
    pages: list[int] = field(default_factory=list)
    cursor: CacheCursor | None = None
    fed: int = 0  # positions whose K/V the sent commands write (speculating: at most)
    prefill_end: int = 0  # positions to prefill since admission: the prompt, plus tokens on a resume
    scheduled: int = 0  # tokens the sent commands sample (a scoring prefill's counts, though dropped)
    epoch: int = 0  # bumped by preemption: tokens of commands sent before it are dropped
    admit_order: int = -1  # for choosing the preemption victim: the newest goes first
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    preemptions: int = 0
    inflight: int = 0  # speculating: commands sent that give it tokens, not yet read
    blocks_sent: int = 0  # speculating: blocks whose page triple was sent since admission
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    grammar: SampleGrammar | None = None  # structured outputs: follows the tokens received
    lora: Registered | None = None  # its LoRA adapter (l3worker.lora.registry); None: the base model
    lora_slot: int = -1  # the device slot its adapter is in while it holds one
    # Running at a chip-child failure, it is a suspect until it has this many tokens (-1: never was);
    # an uncleared suspect is resumed alone among suspects (l3worker.engine.recovery).
    suspect_until: int = -1
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    prev_token_at: float = 0.0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)  # an attribute, not a property: read for every token
        # Prompt and generated ids in one buffer: the prefix cache reads them, a resume prefills them.
        self.ids = np.zeros(self.prompt_len + self.steps_needed, np.int32)
        self.ids[:self.prompt_len] = self.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def steps_needed(self) -> int:
        """Tokens to sample: a scoring request (max_new_tokens 0) still runs its prefill."""
        return max(self.params.max_new_tokens, 1)

    @property
    def known(self) -> int:
        """Ids known so far: the prompt and the tokens received."""
        return self.prompt_len + len(self.tokens)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prefill_end

    @property
    def suspect(self) -> bool:
        return len(self.tokens) < self.suspect_until and not self.finished

    def row_values(self) -> dict[str, Any]:
        """Its per-row fields, as its admit and a full state carry them."""
        scores = self.want_prompt_logprobs and self.preemptions == 0
        spec = self.params.structured_outputs
        constrained = spec is not None
        return row_values(self.params, prompt_len=self.prompt_len, seed=self.seed, stop_ids=sorted(self.stop_ids),
                          prompt_logprobs=self.params.prompt_logprobs if scores else None,
                          grammar=spec.grammar_text if constrained else None,
                          grammar_after=self.params.reasoning_end_token_id if constrained else None,
                          # a resumed sample's matcher in the child replays the tokens it already produced
                          grammar_replay=self.tokens if constrained and self.preemptions else None,
                          cached_ids=None,  # set at admission, where a prefix-cache hit is known
                          lora_slot=self.lora_slot)

    @property
    def kv_end(self) -> int:
        """Positions whose K/V it ever writes: the last sampled token is never fed back."""
        return self.prompt_len + self.steps_needed - 1

    def pages_needed(self, page_size: int) -> int:
        return -(-self.kv_end // page_size)
