"""A cpu decode step over its active lanes alone (chip_child.step.live_lanes): when the rows left
sit above idle lanes, the forward takes only the active ones, and every row's tokens and logits
are those of the step over every lane."""
from __future__ import annotations

import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step import runtime as runtime_module
from chip_child.step.runtime import ChipRuntime

ROWS = 6


def _requests(vocab: int) -> list[LocalRequest]:
    """Row i stops after 3 + 3 i tokens: the low rows finish first, the last one left is row 5."""
    g = torch.Generator().manual_seed(5)
    return [LocalRequest(torch.randint(0, vocab, (4 + 2 * i,), generator=g).tolist(), 3 + 3 * i)
            for i in range(ROWS)]


@pytest.fixture
def runtimes():
    """make(config) -> a ChipRuntime, closed at the end of the test."""
    made: list[ChipRuntime] = []

    def make(cfg: RuntimeConfig) -> ChipRuntime:
        made.append(ChipRuntime(cfg))
        return made[-1]

    yield make
    for rt in made:
        rt.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_above_idle_lanes_give_the_tokens_and_logits_of_every_lane(make_checkpoint, monkeypatch, runtimes,
                                                                         dtype: str) -> None:
    rt = runtimes(RuntimeConfig(str(make_checkpoint("default")), device="cpu", dtype=dtype, max_batch_size=ROWS,
                                max_seq_len=64, page_size=4))
    assert rt.pack_lanes
    forward_rows: list[int] = []
    real = runtime_module.final_logits
    monkeypatch.setattr(runtime_module, "final_logits",
                        lambda w, h, *a, **k: (forward_rows.append(h.shape[0]), real(w, h, *a, **k))[1])
    reqs = _requests(rt.model_cfg.vocab_size)
    packed = LocalDriver(rt).run(reqs, keep_logits=True)
    # The decode steps' forwards: all six rows, then one fewer as each low row finishes.
    decode_rows = forward_rows[1:]
    assert decode_rows[0] == ROWS and decode_rows[-1] == 1 and sorted(decode_rows, reverse=True) == decode_rows

    rt.pack_lanes = False
    forward_rows.clear()
    every_lane = LocalDriver(rt).run(reqs, keep_logits=True)
    assert set(forward_rows[1:]) == {ROWS}  # row 5 stays active to the end: every lane each step
    assert packed.token_ids == every_lane.token_ids
    for a, b in zip(packed.logits, every_lane.logits):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option", [{"max_loras": 1},
                                    {"speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 2}}])
def test_off_with_lora_and_speculation(make_checkpoint, runtimes, option: dict) -> None:
    """Their per-lane inputs (adapter groups, the drafts' hidden states) are not packed: every lane runs."""
    rt = runtimes(RuntimeConfig(str(make_checkpoint("default")), device="cpu", dtype="float32", max_batch_size=2,
                                max_seq_len=32, page_size=4, **option))
    assert not rt.pack_lanes
