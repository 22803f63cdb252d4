"""Steps a runtime runs outside any request: its warm-up, and the timing the cpu layout trial uses."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from chip_child.protocol import Admit, Command, prefill_command
from chip_child.step.row_fields import example_values
from chip_child.step.results import StepOutputs

if TYPE_CHECKING:
    from chip_child.step.host import StepHost


def warm_up(rt: StepHost) -> None:
    """Steps through every code path (a prefill with every optional sampling stage, a mixed step
    of a chunk beside a decoding row, then plain ones), finishing the rows it used. Its grammar
    row takes the path of a row without a compiler (a mask allowing every token): compiling
    would wait for the tokenizer's token trie, seconds of start-up for a large vocabulary."""
    compiler, rt.grammars.compiler = rt.grammars.compiler, None
    try:
        _warm_up_steps(rt)
    finally:
        rt.grammars.compiler = compiler


def _warm_up_steps(rt: StepHost) -> None:
    b = rt.cfg.max_batch_size
    out = torch.zeros(b, dtype=torch.int32)
    outputs = StepOutputs.allocate(b, 2)
    staging = np.zeros(2, np.int32)
    plen = 2 if rt.cfg.max_seq_len > 2 else 1  # two tokens: one prompt log-probability to compute
    page = np.arange(1, 1 + -(-plen // rt.cfg.page_size), dtype=np.int32)
    every = Admit(row=0, **{**example_values(), "prompt_len": plen})
    plain = Admit(row=0, **{**example_values(required_only=True), "prompt_len": plen})  # random and filtered
    step = 0
    for admit in (every, plain):
        rt.execute(prefill_command(step, [(admit, page, 0)]), staging, out, outputs)
        if b > 1:  # a second row prefills while the first decodes
            rt.execute(prefill_command(step + 1, [(replace(admit, row=1), page, 0)]), staging, out, outputs)
        rt.execute(Command(step=step + 2), staging, out, outputs)
        rt.finish_rows(list(range(min(b, 2))))
        step += 3


def time_steps(rt: StepHost, prefill_tokens: int, steps: int, budget_s: float) -> tuple[float, float]:
    """Wall times of a prefill step of about `prefill_tokens` tokens (every row's prompt, of
    equal lengths) and the median of the greedy decode steps that follow with every row
    active, after one untimed one: at most `steps` of them, fewer once `budget_s` is spent
    (at least one). The rows share their pages: the cache's contents do not matter here.
    Leaves an empty batch, and its rows' tables and K/V until rt.reset()."""
    cfg, b = rt.cfg, rt.cfg.max_batch_size
    steps = max(1, min(steps, cfg.max_seq_len - 3))
    longest = cfg.reachable_positions
    if longest < 3:
        raise ValueError("time_steps needs a cache of at least 3 positions per row")
    plen = max(1, min(prefill_tokens // b, cfg.prefill_capacity // b, longest - steps - 1))
    steps = max(1, min(steps, longest - plen - 1))
    out = torch.zeros(b, dtype=torch.int32)
    outputs = StepOutputs.allocate(b, 1)
    staging = np.zeros(b * plen, np.int32)
    pages = np.arange(1, 1 + -(-(plen + steps + 1) // cfg.page_size), dtype=np.int32)
    admits = [(Admit(row=r, prompt_len=plen, temperature=0.0, top_p=1.0, top_k=0, seed=0), pages, r * plen)
              for r in range(b)]
    t0 = time.perf_counter()
    rt.execute(prefill_command(0, admits), staging, out, outputs)
    prefill_s = time.perf_counter() - t0
    rt.execute(Command(step=1), staging, out, outputs)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for step in range(2, 2 + steps):
        t0 = time.perf_counter()
        rt.execute(Command(step=step), staging, out, outputs)
        times.append(time.perf_counter() - t0)
        if t0 > deadline:
            break
    rt.finish_rows(list(range(b)))
    return prefill_s, float(np.median(times))
