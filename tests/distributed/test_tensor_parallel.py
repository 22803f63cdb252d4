"""Tensor parallelism across several chip-children (gloo on the cpu): same tokens as one device."""
from __future__ import annotations

import pytest
import torch

from chip_child.models.loader import load_config
from chip_child.models.qwen3 import shard_config
from l3worker import DistributedWorker, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 45))]


@pytest.mark.parametrize("overrides", [dict(name="tp-bias", attention_bias=True),
                                       dict(name="tp-gqa4", num_attention_heads=8, num_key_value_heads=2,
                                            tie_word_embeddings=True)])
def test_two_children_match_transformers_greedy(make_checkpoint, hf_model, overrides) -> None:
    path = make_checkpoint(**overrides)
    model = hf_model(path)
    ref = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
           for p in PROMPTS]
    with DistributedWorker(str(path), device="cpu", device_ids=(0, 1), max_batch_size=4, max_seq_len=128,
                           page_size=8) as w:
        assert len(set(w.child_pids)) == 2
        outs = w.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24))
        sampled = w.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5))
    assert [o.token_ids for o in outs] == ref
    with DistributedWorker(str(path), device="cpu", max_batch_size=4, max_seq_len=128, page_size=8) as w:
        single = w.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in single]


def test_device_count_must_divide_heads(make_checkpoint) -> None:
    path = make_checkpoint()  # 4 heads, 2 kv heads, intermediate 96
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_config(load_config(path), 4)
    with pytest.raises(ValueError, match="device_ids"):
        DistributedWorker(str(path), device="cpu", device_ids=(0, 1, 2), max_seq_len=128)
