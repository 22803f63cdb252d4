"""Input processing: a request checked and turned into the engine's RequestState, before it is queued.

Every check that can refuse a request runs here, in the caller's thread, and names the field it
refuses: nothing reaches the step loop that the loop would have to refuse later. The state holds
the request's samples (one scheduler Sequence each) and what output processing keeps for them;
it knows nothing of the children.
"""
from __future__ import annotations

import itertools
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from chip_child.models.loader import ModelConfig
from l3worker.structured.request_grammars import ParentGrammars
from l3worker.engine.detokenizer import SampleText
from l3worker.engine.inputs import token_ids
from l3worker.params import SamplingParams, TokenLogprob
from l3worker.engine.scheduler import Sequence

if TYPE_CHECKING:
    from chip_child.step.runtime import RuntimeConfig

# A request without SamplingParams: greedy, DistributedWorker's and the Engine's own default (the
# LLM entrypoint fills in vLLM's defaults before a request gets here).
DEFAULT_PARAMS = SamplingParams(temperature=0.0)


@dataclass
class RequestState:
    """A request inside the engine: its samples, their text, and what was already reported."""

    request_id: str
    prompt: str | None
    prompt_ids: np.ndarray
    params: SamplingParams
    stream: bool  # report deltas every step, not only the final output
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)
    texts: list[SampleText | None] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None  # per sample
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reported: list[int] = field(default_factory=list)  # per sample: tokens already in a delta
    first_token_seen: bool = False
    finished: bool = False
    failures: int = 0  # consecutive chip-child failures it was running at (l3worker.engine.recovery)
    error: str | None = None  # why the engine gave up on it, if it did
    grammar: Future | None = None  # the structured-output constraint compiling (l3worker.structured.request_grammars)

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """Built once: every output of the request shares this list."""
        return self.prompt_ids.tolist()

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class InputProcessor:
    """Validates requests against the model and the runtime's limits and builds their state.
    Request ids (when the caller gives none) and sequence ids are unique per engine."""

    def __init__(self, model_config: ModelConfig, runtime_config: RuntimeConfig, tokenizer, model_dir: str):
        self.model_config = model_config
        self.runtime_config = runtime_config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.grammars = ParentGrammars(model_dir, model_config.vocab_size, model_config.eos_token_ids)

    def process(self, prompt, params: SamplingParams | None, request_id: str | None, stream: bool,
                where: str, arrival: float | None = None, lora=None) -> RequestState:
        """A validated request. Raises ValueError/TypeError naming the field (`where` names the prompt)."""
        params = DEFAULT_PARAMS if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: stop strings need a tokenizer, and {self.model_dir} has no tokenizer.json")
        if params.structured_outputs is not None and not self.grammars.available:
            raise ValueError(f"structured_outputs: grammars need a tokenizer, and {self.model_dir} has no "
                             "tokenizer.json")
        ids = token_ids(prompt, self.tokenizer, self.model_config.vocab_size, where, self.model_dir)
        cfg = self.runtime_config
        if params.max_tokens is None:  # vLLM's "until the sequence is full"
            room = cfg.max_seq_len - len(ids)
            if room < 1:
                raise ValueError(f"{where}: prompt length {len(ids)} leaves no room for output within "
                                 f"max_seq_len={cfg.max_seq_len}")
            if params.min_tokens > room:
                raise ValueError(f"min_tokens must be in [0, {room}] (the room max_tokens=None leaves after the "
                                 f"prompt), got {params.min_tokens}")
            params = replace(params, max_tokens=room)
        steps = max(params.max_tokens, 1)
        if len(ids) + steps > cfg.max_seq_len:
            raise ValueError(f"{where}: prompt length {len(ids)} + max_tokens {params.max_tokens} "
                             f"exceeds max_seq_len={cfg.max_seq_len}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        now = time.perf_counter() if arrival is None else arrival
        state = RequestState(request_id or "", prompt if isinstance(prompt, str) else None, ids, params, stream, now)
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        stop_ids = frozenset(params.stop_token_ids) | eos
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), i, ids, params, (base_seed + i) % 2**63, stop_ids, arrival=now,
                           want_prompt_logprobs=i == 0 and params.prompt_logprobs is not None, lora=lora)
            if seq.pages_needed(cfg.page_size) > cfg.total_pages - 1:
                raise ValueError(f"{where} needs {seq.pages_needed(cfg.page_size)} KV pages, more than "
                                 f"num_pages={cfg.total_pages - 1}")
            state.seqs.append(seq)
            state.texts.append(SampleText(self.tokenizer, params.skip_special_tokens, params.stop,
                                          params.include_stop_str_in_output)
                               if self.tokenizer is not None and (stream or params.stop) else None)
        state.reported = [0] * params.n
        if params.logprobs is not None:
            state.logprobs = [[] for _ in range(params.n)]
        state.request_id = str(next(self._ids)) if request_id is None else request_id
        for seq in state.seqs:
            seq.request_id = state.request_id
        if params.structured_outputs is not None:  # compiles on the pool; the request waits for it, not the caller
            state.grammar = self.grammars.submit(params.structured_outputs)
        return state
