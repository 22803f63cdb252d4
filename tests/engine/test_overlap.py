"""Overlapped steps (`overlap_steps`, on by default on accelerators): a chip-child launches the
next step before it completes and publishes the last. On the cpu the option only reorders the
child's loop, which is what these tests check: the same outputs in order, whatever the pipeline
depth, chunking and sampling features."""
from __future__ import annotations

import numpy as np
import pytest

from l3worker import DistributedWorker, SamplingParams

COMMON = dict(device="cpu", num_threads=1, max_batch_size=3, max_seq_len=128, page_size=8, step_timeout_s=60.0)


def outputs(ckpt, **kw) -> list[tuple]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 300, n).tolist() for n in (5, 40, 1, 23, 9)]
    params = [SamplingParams(max_new_tokens=12 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i,
                             logprobs=2 if i == 1 else None, prompt_logprobs=1 if i == 3 else None)
              for i in range(len(prompts))]
    with DistributedWorker(ckpt, **COMMON, **kw) as w:
        outs = w.generate(prompts, params, use_tqdm=False)
    # TokenLogprob is a dataclass: compared field by field, floats exactly.
    return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


@pytest.mark.parametrize("depth", [1, 2])
def test_overlapped_steps_give_the_same_outputs(make_checkpoint, depth: int) -> None:
    ckpt = make_checkpoint("default")
    for budget in (None, 16):  # whole prompts, and chunks beside decoding rows
        kw = dict(pipeline_depth=depth, max_num_batched_tokens=budget)
        assert outputs(ckpt, overlap_steps=True, **kw) == outputs(ckpt, overlap_steps=False, **kw)


def test_overlap_steps_must_be_a_bool(make_checkpoint) -> None:
    with pytest.raises(TypeError, match="overlap_steps must be a bool or None"):
        DistributedWorker(make_checkpoint("default"), **COMMON, overlap_steps="yes")
