"""How `cpu_layout="auto"` picks a cpu child's layout: a rule from the model's size and the core
count, which a start-up trial overrides only where the machine is loaded or the other layout
wins beyond the trial's noise.

The two layouts (chip_child.device.default_cpu_threads): `every_core`, a thread per core and the
parent sleeping through each step; `spare_core`, a core left to the parent and the socket
threads. Measured on a quiet 2-core box (batch 16): every core ran the decode step 0.77-0.83x and
whole generates 0.70-0.87x the time for models of 1.3M to 15M parameters; models of 40k and 230k
parameters ran their step no faster (their ops are too small to split) and the 40k one's whole
generate 1.8x slower (the parent's work then stalls the child). While one other process keeps a
core busy, every_core's OpenMP team waits for its descheduled thread: the 5M model's decode step
took 11.5 ms on every core against 2.8 quiet, 3.6 on spare_core either way.

A choice by timing alone flipped between back-to-back starts of one model: one round that met a
burst of load elsewhere was enough. So the rule sets the layout, and the trial moves it only where
the other layout's slowest round beats the preferred one's fastest by a margin plus the rounds'
own spread, or where other processes kept more than half a core busy over the trial (then
spare_core: under load the rounds' times swing too much to show it reliably, every_core's loss
is certain); a burst within one round moves nothing. Where the other layout truly is faster by
about the margin, noise can still decide: the rule is meant to be right away from it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from chip_child.device import is_socket_thread, pin_threads
from chip_child.models.loader import ModelConfig

# Weight elements a decode step reads from which every core is preferred: between the 230k- and
# the 1.3M-parameter models above (the ops of smaller ones are too small to split).
EVERY_CORE_MIN_WEIGHTS = 1 << 19
# Where one more core adds at least a third to the compute; beyond that the parent's own core is
# worth more than the extra thread (and a larger team waits on more threads). Measured on 2 cores.
EVERY_CORE_MAX_CORES = 4
# Cores other processes kept busy during the trial (on average) from which the machine counts as
# loaded: every_core's team would wait for a descheduled thread, whatever the rounds' times say.
LOADED_CORES = 0.5
# The other layout's slowest decode round must beat the preferred layout's fastest by this much
# more than the rounds' spread.
SWITCH_MARGIN = 0.10
ROUNDS = 3


def step_weight_elements(cfg: ModelConfig) -> int:
    """The matrix elements a decode step reads under `cfg` (a rank's shard under tensor
    parallelism): the projections (a sparse layer's router and its top_k experts) and the
    lm_head; not the embedding, of which a step reads a few rows."""
    hd, hidden = cfg.head_dim, cfg.hidden_size
    attention = hidden * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    dense = 3 * hidden * cfg.intermediate_size
    sparse_layers = set(cfg.moe.sparse_layers) if cfg.moe is not None else set()
    total = hidden * cfg.vocab_size
    for i in range(cfg.num_layers):
        if i in sparse_layers:
            total += attention + cfg.moe.num_experts * hidden + cfg.moe.top_k * 3 * hidden * cfg.moe.intermediate_size
        else:
            total += attention + dense
    return total


def preferred_cpu_layout(step_weights: int, cores: int) -> str:
    """The timing-free rule: every core where the model's ops are large enough to split and one
    more core is a large share of the machine."""
    big = step_weights >= EVERY_CORE_MIN_WEIGHTS
    return "every_core" if big and 2 <= cores <= EVERY_CORE_MAX_CORES else "spare_core"


def decide_cpu_layout(decode_s: dict[str, list[float]], preferred: str, other_cores: float = 0.0) -> str:
    """spare_core where other processes kept more than LOADED_CORES busy during the trial; else
    `preferred`, unless the other layout's slowest decode step (one time per round) beat the
    preferred layout's fastest by more than SWITCH_MARGIN plus the trial's own spread (the
    largest relative range of one layout's rounds): noise that moves every round of one layout
    the same way still cannot flip the choice, a layout several times slower does."""
    if other_cores > LOADED_CORES:
        return "spare_core"
    other = "spare_core" if preferred == "every_core" else "every_core"
    spread = max(max(times) / min(times) - 1 for times in decode_s.values())
    if max(decode_s[other]) * (1 + SWITCH_MARGIN + spread) < min(decode_s[preferred]):
        return other
    return preferred


@dataclass(frozen=True)
class LayoutCores:
    """Where a cpu child's threads run under each layout. `spare` is the child's share under
    spare_core (every core where nothing is pinned: pin_cores=False), `service` the core left to
    the parent and every socket thread (empty: socket threads unpinned)."""

    every: list[int]
    spare: list[int]
    service: list[int]

    def mask(self, layout: str) -> list[int]:
        return self.every if layout == "every_core" else self.spare

    def threads(self, layout: str) -> int:
        return len(self.every) if layout == "every_core" else max(1, len(self.every) - 1)

    def socket_cores(self, layout: str) -> list[int]:
        """Where socket threads run under `layout`: as a worker started with that layout fixed
        puts them (spare_core: the service core; every_core: anywhere)."""
        return self.service if layout == "spare_core" and self.service else self.every


def read_trial(trial: dict) -> tuple[str, LayoutCores]:
    """A ChildSpec.layout_trial: the preferred layout and both layouts' cores."""
    fields = dict(trial)
    return fields.pop("preferred"), LayoutCores(**fields)


def choose_cpu_layout(time_steps: Callable[[], tuple[float, float]], cores: LayoutCores, preferred: str,
                      rounds: int = ROUNDS) -> dict:
    """Times `time_steps()` (seconds of a prefill step and of a decode step) under the
    `spare_core` and `every_core` layouts (`cores`), alternated over `rounds`, from threads set
    up as `preferred` has them; sets every thread of this process as decide_cpu_layout says, given
    the rounds' decode times and the cores other processes kept busy meanwhile (socket threads
    too: where a worker started with the chosen layout fixed would have them). Returns the
    choice, the preferred layout, the median times, that load and how long the trial took."""
    t0 = time.perf_counter()
    busy0 = _others_busy_s()
    times: dict[str, list[tuple[float, float]]] = {"spare_core": [], "every_core": []}
    try:
        for _ in range(rounds):
            for layout in times:
                set_layout(layout, cores)
                times[layout].append(tuple(time_steps()))
    except BaseException:
        set_layout(preferred, cores)
        raise
    busy1 = _others_busy_s()
    other_cores = (busy1 - busy0) / (time.perf_counter() - t0) if busy0 is not None and busy1 is not None else 0.0
    chosen = decide_cpu_layout({layout: [d for _, d in t] for layout, t in times.items()}, preferred, other_cores)
    set_layout(chosen, cores)
    median = lambda xs: float(sorted(xs)[len(xs) // 2])  # noqa: E731
    step_s = {layout: {"prefill": median([p for p, _ in t]), "decode": median([d for _, d in t])}
              for layout, t in times.items()}
    return {"layout": chosen, "preferred": preferred, "step_s": step_s, "other_cores": max(other_cores, 0.0),
            "trial_s": time.perf_counter() - t0}


def _others_busy_s() -> float | None:
    """Busy core-seconds of the whole machine so far less this process's own CPU time (every
    thread's); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    return busy - sum(os.times()[:2])


def set_layout(layout: str, cores: LayoutCores) -> None:
    """Every thread of this process on the layout's cores (OpenMP workers started under
    every_core stay outside spare_core's smaller team), socket threads where that layout puts
    them, and the layout's intra-op thread count."""
    pin_threads(lambda _, name: cores.socket_cores(layout) if is_socket_thread(name) else cores.mask(layout))
    torch.set_num_threads(cores.threads(layout))
