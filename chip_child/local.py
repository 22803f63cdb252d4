"""Drives a ChipRuntime in-process: no parent, no IPC. Used by tests and as the benchmark floor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass

import numpy as np
import torch

from chip_child.protocol import Admit, Command, FullState, prefill_command
from chip_child.step.row_fields import dataclass_fields, row_values
from chip_child.step.runtime import ChipRuntime, StepOutputs


LocalRequest = make_dataclass(
    "LocalRequest", [("prompt", list[int]), ("max_new_tokens", int),
                     *(spec for spec in dataclass_fields(required=False)
                       if spec[0] not in ("prompt_len", "max_new_tokens"))],
    namespace={"__module__": __name__, "__doc__": """A prompt, how many tokens to generate, and any per-row
    field of chip_child.step.row_fields by its Admit name (neutral by default: greedy, no options)."""})


def _row_values(r: LocalRequest) -> dict:
    return row_values(r, prompt_len=len(r.prompt))  # max_new_tokens: the request's own


@dataclass
class Logprobs:
    """One position's log-probabilities: the chosen (sampled or prompt) token's, and the top N."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class LocalResult:
    token_ids: list[list[int]]
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # per request, one [V] per token
    # Per request that asked (else None): one entry per generated token ...
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)
    # ... and one per prompt token after the first.
    prompt_logprobs: list[list[Logprobs] | None] = field(default_factory=list)


class LocalDriver:
    """Admits up to max_batch_size requests in one prefill, then decodes until all reach
    max_new_tokens. Pages are handed out interleaved across rows so block tables are not
    contiguous, and each page boundary crosses as a (row, block, page) triple."""

    def __init__(self, rt: ChipRuntime):
        self.rt = rt
        self.page = rt.cfg.page_size
        self.step = 0
        self.out = torch.zeros(rt.cfg.max_batch_size, dtype=torch.int32)
        self.outputs = StepOutputs.allocate(rt.cfg.max_batch_size, rt.cfg.prefill_capacity)
        self._free_pages = list(range(1, rt.cfg.total_pages))

    def _take_page(self) -> int:
        return self._free_pages.pop(0)

    def run(self, requests: list[LocalRequest], keep_logits: bool = False) -> LocalResult:
        rt, page = self.rt, self.page
        if len(requests) > rt.cfg.max_batch_size:
            raise ValueError("LocalDriver admits at most max_batch_size requests")
        staging = np.concatenate([np.asarray(r.prompt, np.int32) for r in requests])
        offsets = np.concatenate([[0], np.cumsum([len(r.prompt) for r in requests])[:-1]]).astype(int)
        pages = [[] for _ in requests]
        for blk in range(max(math.ceil(len(r.prompt) / page) for r in requests)):
            for i, r in enumerate(requests):
                if blk < math.ceil(len(r.prompt) / page):
                    pages[i].append(self._take_page())
        admits = [(Admit(i, **_row_values(r)), np.array(pages[i], np.int32), int(offsets[i]))
                  for i, r in enumerate(requests)]
        result = LocalResult(token_ids=[[] for _ in requests], logits=[[] for _ in requests],
                             logprobs=[[] if r.logprobs >= 0 else None for r in requests],
                             prompt_logprobs=[None] * len(requests))
        step = self._execute(prefill_command(self.step, admits), staging, requests, result, keep_logits)
        for i, r in enumerate(requests):
            if r.prompt_logprobs >= 0:
                assert step.prompt_logprobs or len(r.prompt) == 1
                rows = range(int(offsets[i]), int(offsets[i]) + len(r.prompt) - 1)
                result.prompt_logprobs[i] = [self._read(self.outputs.prompt_logprobs, self.outputs.prompt_logprob_ids,
                                                        j, r.prompt_logprobs) for j in rows]
        positions = [len(r.prompt) for r in requests]
        finished: list[int] = []
        while any(len(t) < r.max_new_tokens for t, r in zip(result.token_ids, requests)):
            triples = []
            for i, r in enumerate(requests):
                if i in finished or len(result.token_ids[i]) >= r.max_new_tokens:
                    continue
                if positions[i] % page == 0:
                    pages[i].append(self._take_page())
                    triples.append((i, positions[i] // page, pages[i][-1]))
            done = [i for i, (t, r) in enumerate(zip(result.token_ids, requests))
                    if len(t) >= r.max_new_tokens and i not in finished]
            finished += done
            cmd = Command(step=self.step, finished_rows=done, new_pages=np.array(triples, np.int32).reshape(-1, 3))
            if rt.cfg.copy_policy == "always":
                cmd.full_state = self._full_state(requests, positions, pages, finished)
            self._execute(cmd, staging, requests, result, keep_logits, skip=finished)
            for i in range(len(requests)):
                if i not in finished:
                    positions[i] += 1
        self._execute_finish(list(range(len(requests))), finished)
        return result

    def _execute(self, cmd, staging, requests, result, keep_logits, skip=()):
        step = self.rt.execute(cmd, staging, self.out, self.outputs)
        self.step += 1
        for i, r in enumerate(requests):
            if i not in skip:
                result.token_ids[i].append(int(self.out[i]))
                if keep_logits:
                    result.logits[i].append(self.rt.logits[i].clone())
                if r.logprobs >= 0:
                    assert step.logprobs >= r.logprobs, "a row asked for log-probabilities the step did not write"
                    result.logprobs[i].append(self._read(self.outputs.logprobs, self.outputs.logprob_ids, i,
                                                         r.logprobs))
        return step

    @staticmethod
    def _read(values: torch.Tensor, ids: torch.Tensor, row: int, n: int) -> Logprobs:
        return Logprobs(float(values[row, 0]), ids[row, :n].tolist(), values[row, 1:1 + n].tolist())

    def _execute_finish(self, rows: list[int], already: list[int]) -> None:
        """Frees the rows and pages so the driver can run another batch."""
        rest = [r for r in rows if r not in already]
        if rest:
            self.rt.finish_rows(rest)
        self._free_pages = list(range(1, self.rt.cfg.total_pages))

    def _full_state(self, requests, positions, pages, finished) -> FullState:
        cfg = self.rt.cfg
        b = cfg.max_batch_size
        table = np.zeros((b, cfg.max_blocks_per_row), np.int32)
        pos = np.zeros(b, np.int64)
        active = np.zeros(b, bool)
        for i, r in enumerate(requests):
            table[i, :len(pages[i])] = pages[i]
            if i not in finished:
                active[i] = True
                pos[i] = positions[i]
        page = self.page
        slots = np.where(active, table[np.arange(b), pos // page].astype(np.int64) * page + pos % page, 0)
        return FullState.from_rows(pos, active, table, slots, ((i, _row_values(r)) for i, r in enumerate(requests)))


def batch_commands(step: int, admits: list[Admit], prompt_lens: list[int], new_tokens: int, page_size: int,
                   free_pages: list[int], finished_rows: list[int]) -> tuple[list[Command], list[list[int]]]:
    """What the scheduler sends for one batch admitted at once (row i is admits[i], its prompt at
    staging offset sum(prompt_lens[:i])): a prefill of every prompt, then new_tokens - 1 decode
    steps, pages taken from `free_pages` in the scheduler's order (prompt pages at admission, a
    triple at each page boundary). Returns the commands and each row's pages, for the caller
    to give back."""
    offsets = np.cumsum([0] + prompt_lens[:-1]).tolist()
    owned = [[free_pages.pop(0) for _ in range(math.ceil(n / page_size))] for n in prompt_lens]
    prompts = [(a, np.array(pages, np.int32), off) for a, pages, off in zip(admits, owned, offsets)]
    cmds = [prefill_command(step, prompts, finished_rows=finished_rows)]
    for k in range(1, new_tokens):
        triples = []
        for row, n in enumerate(prompt_lens):
            pos = n + k - 1  # this step's input position
            if pos % page_size == 0:
                owned[row].append(free_pages.pop(0))
                triples.append((row, pos // page_size, owned[row][-1]))
        cmds.append(Command(step + k, new_pages=np.array(triples, np.int32).reshape(-1, 3)))
    return cmds, owned
