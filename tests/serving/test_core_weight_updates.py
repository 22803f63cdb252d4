"""update_weights_from_tensor across processes: an API server's CoreClient writes the tensors to
shared memory bucket by bucket, and the engine core in its own process loads them into its
chip-children. Tokens are checked against transformers on the checkpoint pushed."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch
from safetensors.torch import load_file

from l3worker import SamplingParams
from l3worker.serving.launcher import launch_core
from parity import hf_greedy

PROMPTS = [[1, 2, 3, 4, 5, 6], [200, 17, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_tensors_reach_an_engine_core_in_another_process_through_shared_memory(make_checkpoint, hf_model) -> None:
    a, b = make_checkpoint("rollout-a", seed=0), make_checkpoint("rollout-b", seed=1)
    new = load_file(str(b / "model.safetensors"))
    want = [hf_greedy(hf_model(b), p, 12) for p in PROMPTS]
    kwargs = dict(model_dir=str(a), device="cpu", max_batch_size=2, max_seq_len=128, page_size=8, num_threads=1)

    async def tokens(client) -> list[list[int]]:
        got = []
        for i, prompt in enumerate(PROMPTS):
            async for out in client.generate(prompt, GREEDY, f"r{i}-{len(got)}"):
                final = out
            got.append(final.outputs[0].token_ids)
        return got

    async def run() -> tuple:
        launch, client = launch_core(kwargs, 1)
        try:
            await client.start()
            before = await tokens(client)
            result = await client.update_weights_from_tensor(new, weight_version="trained-1",
                                                             bucket_bytes=sum(t.nbytes for t in new.values()) // 5)
            after = await tokens(client)
            with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[3\]"):
                await client.update_weights_from_tensor({"model.norm.weight": torch.zeros(3)})
            again = await tokens(client)
            return before, result, after, again
        finally:
            await client.shutdown()

    before, result, after, again = asyncio.run(run())
    assert result["weight_version"] == "trained-1" and result["pending_tensors"] == []
    assert before != want and after == want and again == want
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"l3worker-weights-{os.getpid()}-")]
