"""The masked LoRA path a decode graph captures (chip_child.models.lora.LoraStep), driven on the cpu
through a stand-in capture: the runtime with decode graphs and adapters gives the tokens of the
eager (grouped) runtime, rows on the base model and on two adapters side by side."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.models.loader import load_config
from chip_child.step.runtime import ChipRuntime
from graph_helpers import StandInCapturer
from l3worker import SamplingParams
from l3worker.engine.scheduler import Scheduler, Sequence
from l3worker.lora import LoRARequest
from l3worker.lora.registry import LoraRegistry
from lora_adapters import peft_model, write_adapter
from parity import hf_greedy

PROMPTS = [[3, 1, 4, 1, 5], list(range(10, 31)), [7] * 9, [2, 7, 9, 11]]


def run(path: str, adapters: list, capturer: StandInCapturer | None, device: str = "cpu",
        graphs: bool | None = None) -> list[list[int]]:
    """Greedy tokens of PROMPTS, each on its adapter (None: the base model), through the scheduler
    and one ChipRuntime on `device`; `graphs` sets decode graphs (None: the device's default)."""
    cfg = RuntimeConfig(path, device=device, dtype="float32", max_batch_size=4, max_seq_len=64, page_size=4,
                        max_prefill_tokens=16, max_loras=2, max_lora_rank=8, decode_graphs=graphs)
    rt = ChipRuntime(cfg, graph_capturer=capturer)
    book = LoraRegistry(load_config(path), 2, 8)
    try:
        sched = Scheduler(max_batch_size=4, page_size=4, max_blocks_per_row=cfg.max_blocks_per_row,
                          num_pages=cfg.total_pages - 1, max_num_batched_tokens=16, enable_prefix_caching=True,
                          full_state=False, loras=book)
        params = SamplingParams(temperature=0.0, max_new_tokens=12)
        seqs = []
        for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
            seq = Sequence(i, 0, np.asarray(prompt, np.int32), params, 0, frozenset())
            if adapter is not None:
                book.add(adapter)
                seq.lora = book.get(adapter.lora_int_id)
            seqs.append(seq)
        sched.add(seqs)
        out = torch.zeros(4, dtype=torch.int32)
        staging = np.zeros(cfg.prefill_capacity + 1, np.int32)
        while (s := sched.next_command()) is not None:
            for slot, file in sched.lora_loads:
                rt.lora.load(slot, file)
            sched.lora_loads = []
            for offset, ids in s.staging_tokens:
                staging[offset:offset + len(ids)] = ids
            rt.execute(s.command, staging, out)
            sched.on_tokens(s.producers, out.numpy(), time.perf_counter())
        return [seq.tokens for seq in seqs]
    finally:
        book.close()
        rt.close()


def test_decode_graphs_replay_the_masked_adapters_with_the_eager_tokens(make_checkpoint, tmp_path) -> None:
    base = make_checkpoint()
    a0 = LoRARequest("a0", 1, str(write_adapter(base, tmp_path / "a0", seed=31, r=4)))
    a1 = LoRARequest("a1", 2, str(write_adapter(base, tmp_path / "a1", seed=32, r=8)))
    adapters = [a0, None, a1, a0]
    eager = run(str(base), adapters, None)
    capturer = StandInCapturer()
    graphed = run(str(base), adapters, capturer)
    assert capturer.captured and capturer.replays
    assert graphed == eager
    assert run(str(base), [None] * 4, None) != eager  # the adapters change the tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_and_eager_give_the_tokens_of_peft(make_checkpoint, tmp_path) -> None:
    """On a GPU: real decode graphs replay the masked adapters with the eager tokens, and both give
    peft's greedy tokens for each adapter."""
    base = make_checkpoint()
    p0, p1 = write_adapter(base, tmp_path / "a0", seed=31, r=4), write_adapter(base, tmp_path / "a1", seed=32, r=8)
    adapters = [LoRARequest("a0", 1, str(p0)), None, LoRARequest("a1", 2, str(p1)), LoRARequest("a0", 1, str(p0))]
    eager = run(str(base), adapters, None, device="cuda", graphs=False)
    assert run(str(base), adapters, None, device="cuda", graphs=True) == eager
    models = {1: peft_model(base, p0), 2: peft_model(base, p1)}
    for prompt, adapter, got in zip(PROMPTS, adapters, eager):
        if adapter is not None:
            assert got == hf_greedy(models[adapter.lora_int_id], prompt, 12), adapter.lora_name
