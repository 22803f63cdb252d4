"""The prefill cap from step times (l3worker/engine/step_timing.py), and the step loop feeding it."""
from __future__ import annotations

import pytest

from l3worker import DistributedWorker, SamplingParams
from l3worker.engine import step_timing
from l3worker.engine.step_timing import MIN_CHUNK_TOKENS, StepTiming


def test_no_cap_until_a_decode_step_and_a_prompt_token_were_timed() -> None:
    t = StepTiming()
    assert t.prefill_cap() is None
    t.observe(0.040, prompt_tokens=0, decode_rows=16)
    assert t.prefill_cap() is None  # no prompt token timed yet
    t.observe(0.040 + 100 * 0.0005, prompt_tokens=100, decode_rows=16)  # beyond the decode step: 0.5 ms a token
    assert t.prefill_cap() == pytest.approx(80, abs=1)  # 40 ms of prompt tokens


def test_a_prefill_only_step_times_its_tokens_and_the_cap_has_a_floor() -> None:
    t = StepTiming()
    t.observe(1.0, prompt_tokens=100, decode_rows=0)  # 10 ms a token
    t.observe(0.002, prompt_tokens=0, decode_rows=1)
    assert t.prefill_cap() == MIN_CHUNK_TOKENS  # 0.2 tokens' time, raised to the floor


def test_the_estimates_follow_the_steps_and_a_zero_ratio_turns_the_cap_off(monkeypatch) -> None:
    t = StepTiming()
    for _ in range(50):
        t.observe(0.010, prompt_tokens=0, decode_rows=4)
        t.observe(0.010 + 64 * 0.0001, prompt_tokens=64, decode_rows=4)
    assert t.decode_s == pytest.approx(0.010) and t.token_s == pytest.approx(0.0001)
    assert t.prefill_cap() == pytest.approx(100, abs=1)
    monkeypatch.setattr(step_timing, "PREFILL_TIME_RATIO", 0.0)
    assert t.prefill_cap() is None


def test_the_step_loop_times_steps_and_leaves_offline_runs_uncapped(make_checkpoint) -> None:
    """Offline generate() keeps the token budget alone (its schedule, and so speculation's counters,
    repeat run to run) while the step loop times its steps; a served engine gets the cap
    (tests/engine/test_engine.py, through AsyncEngine)."""
    prompts = [[3, 1, 4, 1, 5] * 4, [2, 7] * 3, [9] * 12]  # on two rows: the third starts beside a decoding row
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 4, 6)]
    with DistributedWorker(str(make_checkpoint()), max_batch_size=2, max_seq_len=64, page_size=4,
                           max_num_batched_tokens=16) as w:
        w.generate(prompts, params)
        timing = w.engine.step_timing
        assert timing.decode_s > 0 and timing.token_s > 0 and timing.prefill_cap() >= MIN_CHUNK_TOKENS
        assert w.engine.scheduler.prefill_cap is None

