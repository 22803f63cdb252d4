"""The parent's side of speculative decoding: how many drafts a step may carry, and the counts.

The child drafts and verifies (chip_child.spec.speculation); each step it leaves, per row, the tokens
it produced and the drafts it verified in the ring. The scheduler reads the tokens; this module
counts drafts and acceptance with vLLM's meanings: a draft is one row's proposal in one step,
its tokens are draft tokens, and accepted tokens are those equal to the target's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from chip_child.config import RuntimeConfig
from chip_child.spec.eagle3 import head_config
from chip_child.models.loader import ModelConfig, load_config
from chip_child.models.qwen3 import shard_config
from chip_child.spec.config import SpeculativeConfig
from l3worker.engine.metrics import EngineMetrics
from l3worker.engine.scheduler import Scheduler
from l3worker.engine.sequence import Sequence


def speculative_tokens(cfg: RuntimeConfig) -> int:
    """k: drafts a row verifies per step at most (0: no speculation)."""
    return int(cfg.speculative["num_speculative_tokens"]) if cfg.speculative else 0


def check_proposer(speculative: SpeculativeConfig, target: ModelConfig, tp_size: int) -> SpeculativeConfig:
    """Checks the draft model or EAGLE-3 head against the target before any child starts (its
    path made absolute: the children resolve it from elsewhere); ValueErrors name what differs."""
    if speculative.model is None:
        return speculative
    speculative = replace(speculative, model=str(Path(speculative.model).expanduser().resolve()))
    if speculative.method == "eagle3":
        head_config(speculative.model, target)
        return speculative
    draft = load_config(speculative.model)
    shard_config(draft, tp_size)  # tensor parallelism must divide the draft's heads and MLP too
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocab_size {draft.vocab_size} differs from "
                         f"the target's {target.vocab_size}")
    return speculative


@dataclass
class SpecCounts:
    k: int
    metrics: EngineMetrics | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    undrafted_tokens: int = 0  # produced by rows that verified no draft (see count)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.k

    def count(self, rows: list[int], counts: np.ndarray) -> None:
        """One step's rows (those whose tokens are taken) and the ring's [B, 2] counts:
        (tokens produced, drafts verified)."""
        if not rows or not self.k:
            return
        made, drafted = counts[rows, 0].astype(np.int64), counts[rows, 1].astype(np.int64)
        verified = drafted > 0
        # Tokens decoded without speculation: steps that carry a prompt chunk run plain, penalized
        # and constrained rows get no drafts, and a proposer may find nothing to propose.
        undrafted = int(made[~verified].sum())
        self.undrafted_tokens += undrafted
        if undrafted and self.metrics is not None:
            self.metrics.spec_undrafted_tokens.inc(undrafted)
        if not verified.any():
            return
        accepted = (made - 1)[verified]
        per_position = np.bincount(accepted, minlength=self.k + 1)[::-1].cumsum()[::-1][1:]  # accepted > j
        drafts, tokens, total = int(verified.sum()), int(drafted.sum()), int(accepted.sum())
        self.drafts += drafts
        self.draft_tokens += tokens
        self.accepted_tokens += total
        for j, n in enumerate(per_position.tolist()):
            self.accepted_per_position[j] += n
        m = self.metrics
        if m is not None:
            m.spec_drafts.inc(drafts)
            m.spec_draft_tokens.inc(tokens)
            m.spec_accepted_tokens.inc(total)
            for j, n in enumerate(per_position.tolist()):
                if n:
                    m.spec_accepted_per_position.labels(str(j)).inc(n)

    def summary(self) -> dict:
        """The counts, the acceptance rate of draft tokens, and the mean accepted length (tokens a
        verifying row produces per step: 1 + accepted / drafts, vLLM's definition)."""
        return {
            "num_speculative_tokens": self.k, "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted_tokens, "num_undrafted_tokens": self.undrafted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "mean_accepted_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None,
        }


def take_speculative_step(spec: SpecCounts, scheduler: Scheduler, producers: list[tuple[int, Sequence, int]],
                          counts: np.ndarray, ids: np.ndarray, now: float,
                          take: Callable[[list[tuple[int, Sequence]], int], None]) -> None:
    """A speculative run's step, from its ring slot's counts [B, 2] and ids [B, k + 1]: each row gave
    0 to k + 1 tokens. They are taken one token position j at a time (`take(advanced, j)` hands them
    to output processing with position j's log-probabilities), so stops, max_tokens and stop strings
    end a row exactly where plain decoding would, and the tokens after are dropped."""
    spec.count([row for row, seq, epoch in producers if not seq.finished and epoch == seq.epoch], counts)
    for j in range(spec.k + 1):
        taking = [p for p in producers if counts[p[0], 0] > j]
        if j and not taking:
            break
        take(scheduler.on_tokens(taking, ids[:, j], now), j)
    scheduler.settle(producers)
