"""Output processing without children: hand-made sequences fed tokens the way the step loop does
(Scheduler.on_tokens, then OutputProcessor.process), checking deltas, held-back stop text, n > 1
final outputs, log-probabilities and metrics."""
from __future__ import annotations

import numpy as np
import pytest

from chip_child.models.loader import load_config, load_tokenizer
from chip_child.step.runtime import RuntimeConfig
from chip_child.models.tiny_model import ensure_tiny_model
from prometheus_client import CollectorRegistry, Histogram

from l3worker.engine.metrics import EngineMetrics, observe_repeated
from l3worker.engine.outputs import OutputProcessor, SlotLogprobs
from l3worker.params import SamplingParams
from l3worker.engine.requests import InputProcessor, RequestState
from l3worker.engine.scheduler import Scheduler
from l3worker.engine.stats import GenerateStats

EOS = 256  # the built-in model's tokenizer: ids 0..255 are the bytes, 256 is <|endoftext|>
ARRIVAL = 100.0


class Loop:
    """What the engine's loop does around output processing, with the sampled ids given by hand."""

    def __init__(self, tiny):
        self.scheduler = Scheduler(max_batch_size=4, page_size=4, max_blocks_per_row=16, num_pages=64,
                                   max_num_batched_tokens=64, enable_prefix_caching=False, full_state=False)
        self.metrics = EngineMetrics(running=lambda: 0, waiting=lambda: 0, kv_usage=lambda: 0.0)
        tokenizer = load_tokenizer(tiny)
        self.inputs = InputProcessor(load_config(tiny), RuntimeConfig(str(tiny), max_seq_len=64, page_size=4),
                                     tokenizer, str(tiny))
        self.outputs = OutputProcessor(tokenizer, self.metrics, self.scheduler.finish)
        self.now = ARRIVAL

    def add(self, prompt: str, params: SamplingParams, stream: bool) -> RequestState:
        state = self.inputs.process(prompt, params, None, stream, "prompt", arrival=ARRIVAL)
        for seq in state.seqs:
            seq.admitted_at = ARRIVAL + 0.25
        self.outputs.add(state)
        return state

    def step(self, state: RequestState, tokens: dict[int, int], logprobs: SlotLogprobs | None = None,
             scoring=()) -> list:
        """One step in which sample i of `state` (in row i) sampled tokens[i]; one second later than the last."""
        self.now += 1.0
        ids = np.zeros(4, np.int32)
        producers = []
        for i, token in tokens.items():
            ids[i] = token
            producers.append((i, state.seqs[i], state.seqs[i].epoch))
        advanced = self.scheduler.on_tokens(producers, ids, self.now)
        outputs = []
        self.outputs.process(advanced, self.now, outputs, logprobs, scoring)
        return outputs


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_model()


@pytest.fixture
def loop(tiny) -> Loop:
    return Loop(tiny)


def feed(loop: Loop, state: RequestState, text: str) -> list[list]:
    """Feeds one sample the bytes of `text`, one a step; returns each step's outputs."""
    return [loop.step(state, {0: b}) for b in text.encode()]


def test_streamed_deltas_add_up_to_the_final_text_and_tokens(loop) -> None:
    text = "Grüße, world"  # multi-byte characters: a delta never carries half of one
    data = text.encode()
    state = loop.add("hi", SamplingParams(temperature=0.0, max_new_tokens=len(data)), stream=True)
    steps = feed(loop, state, text)
    outs = [o for step in steps for o in step]
    assert all(len(step) <= 1 for step in steps)
    final = outs[-1]
    assert final.finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
    assert "".join(o.outputs[0].delta_text for o in outs) == final.outputs[0].text == text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.outputs[0].token_ids == list(data)
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt_token_ids == list(b"hi")
    assert state.request_id not in loop.outputs.requests
    # "ü" is two bytes: the step of its first byte has no text to hand out.
    first_of_u = data.index("ü".encode())
    assert steps[first_of_u][0].outputs[0].delta_text == ""


def test_a_non_streaming_request_reports_only_its_final_output(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=3), stream=False)
    steps = feed(loop, state, "abc")
    assert steps[:2] == [[], []]
    (final,) = steps[2]
    sample = final.outputs[0]
    assert final.finished and sample.text == sample.delta_text == "abc"  # nothing was reported before
    assert sample.token_ids == sample.delta_token_ids == list(b"abc")


def test_stop_string_is_held_back_then_cut_from_the_text(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=20, stop=("STOP",)), stream=True)
    steps = feed(loop, state, "abSTOP")
    deltas = [o.outputs[0].delta_text for step in steps for o in step]
    # The last len("STOP") - 1 characters stay back while they could start the stop string.
    assert deltas == ["", "", "", "a", "b", ""]
    final = steps[-1][-1]
    sample = final.outputs[0]
    assert final.finished and sample.text == "ab"
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "STOP")
    assert sample.token_ids == list(b"abSTOP")
    assert state.seqs[0].finished and state.seqs[0].row == -1
    assert loop.step(state, {0: ord("c")}) == []  # a token still in flight for the finished row is dropped


def test_held_back_text_that_is_no_stop_string_comes_out_at_the_end(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=7, stop=("STOP",)), stream=True)
    outs = [o for step in feed(loop, state, "abcdSTx") for o in step]
    deltas = [o.outputs[0].delta_text for o in outs]
    assert deltas == ["", "", "", "a", "b", "c", "dSTx"]  # "ST" could have begun "STOP" until the end
    assert "".join(deltas) == outs[-1].outputs[0].text == "abcdSTx"
    assert outs[-1].outputs[0].finish_reason == "length"


def test_n_samples_give_one_final_output_with_every_sample(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, n=2, max_new_tokens=3), stream=False)
    assert loop.step(state, {0: ord("a"), 1: ord("b")}) == []
    assert loop.step(state, {0: EOS, 1: ord("b")}) == []  # sample 0 stops; sample 1 runs on
    assert state.seqs[0].finished and not state.seqs[1].finished
    (final,) = loop.step(state, {1: ord("c")})
    assert final.finished
    first, second = final.outputs
    assert (first.index, first.token_ids, first.text, first.finish_reason, first.stop_reason) == \
        (0, [ord("a"), EOS], "a", "stop", EOS)
    assert (second.index, second.token_ids, second.text, second.finish_reason) == \
        (1, [ord("b"), ord("b"), ord("c")], "bbc", "length")
    assert state.request_id not in loop.outputs.requests


def test_streamed_n_samples_report_only_samples_that_advanced(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, n=2, max_new_tokens=2), stream=True)
    (out,) = loop.step(state, {1: ord("q")})
    assert [(c.index, c.delta_token_ids) for c in out.outputs] == [(1, [ord("q")])]
    (out,) = loop.step(state, {0: ord("p"), 1: ord("r")})
    assert [(c.index, c.delta_token_ids) for c in out.outputs] == [(0, [ord("p")]), (1, [ord("r")])]
    (final,) = loop.step(state, {0: ord("s")})
    assert final.finished
    # The final output is cumulative over every sample, not only the one that advanced.
    assert [(c.index, c.token_ids, c.delta_token_ids) for c in final.outputs] == \
        [(0, [ord("p"), ord("s")], [ord("s")]), (1, [ord("q"), ord("r")], [])]


def test_abort_reports_a_final_output_with_what_was_produced(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=9), stream=True)
    feed(loop, state, "ab")
    loop.scheduler.finish(state.seqs[0], "abort")
    outputs = []
    loop.outputs.report(state, outputs)
    (final,) = outputs
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == list(b"ab") and final.outputs[0].text == "ab"
    assert loop.metrics.value("l3worker:request_success_total", {"finished_reason": "abort"}) == 1


def test_logprobs_are_read_from_the_step_slot(loop) -> None:
    k = 4
    slot = SlotLogprobs(np.zeros((4, 1 + k), np.float32), np.zeros((4, k), np.int32),
                        np.zeros((8, 1 + k), np.float32), np.zeros((8, k), np.int32))
    state = loop.add("wxyz", SamplingParams(temperature=0.0, max_new_tokens=1, logprobs=2, prompt_logprobs=1), stream=False)
    slot.logprobs[0] = [-0.5, -0.25, -0.5, -3.0, -4.0]
    slot.logprob_ids[0] = [7, ord("a"), 9, 10]
    # Prompt entry j holds the log-probability of prompt token j + 1: one chunk of the whole prompt.
    slot.prompt_logprobs[:3, 0] = [-1.0, -2.0, -3.0]
    slot.prompt_logprobs[:3, 1] = [-0.125, -0.25, -0.375]
    slot.prompt_logprob_ids[:3, 0] = [1, 2, 3]
    (final,) = loop.step(state, {0: ord("a")}, slot, scoring=[(0, 0, 4, state.seqs[0])])
    (lp,) = final.outputs[0].logprobs
    assert (lp.token_id, lp.logprob, lp.top) == (ord("a"), -0.5, ((7, -0.25), (ord("a"), -0.5)))
    assert final.prompt_logprobs[0] is None
    assert [(p.token_id, p.logprob, p.top) for p in final.prompt_logprobs[1:]] == \
        [(ord("x"), -1.0, ((1, -0.125),)), (ord("y"), -2.0, ((2, -0.25),)), (ord("z"), -3.0, ((3, -0.375),))]


def test_metrics_count_tokens_requests_and_latencies(loop) -> None:
    recorder = loop.outputs.recorder = GenerateStats()
    state = loop.add("four", SamplingParams(temperature=0.0, n=2, max_new_tokens=3), stream=True)
    for _ in range(3):
        loop.step(state, {0: ord("a"), 1: ord("b")})
    value = loop.metrics.value
    assert value("l3worker:generation_tokens_total") == 6 == recorder.generated_tokens
    assert value("l3worker:prompt_tokens_total") == 4  # once per request, not per sample
    assert value("l3worker:request_success_total", {"finished_reason": "length"}) == 1
    assert value("l3worker:time_to_first_token_seconds_count") == 1
    assert value("l3worker:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value("l3worker:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value("l3worker:inter_token_latency_seconds_count") == 4  # 2 per sample of 3 tokens
    assert value("l3worker:inter_token_latency_seconds_sum") == pytest.approx(4.0)
    assert value("l3worker:e2e_request_latency_seconds_count") == 1
    assert recorder.ttft_s == pytest.approx([1.0, 1.0]) and recorder.tpot_s == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("value", [0.0001, 0.0002, 0.003, 0.0301, 2.5, 9.0])  # below, on, between, past edges
def test_repeated_observations_record_what_as_many_observe_calls_do(value: float) -> None:
    buckets = (0.0002, 0.0005, 0.001, 0.005, 0.03, 2.5)
    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    a = Histogram("gap_seconds", "gaps", buckets=buckets, registry=one_by_one)
    b = Histogram("gap_seconds", "gaps", buckets=buckets, registry=at_once)
    for _ in range(7):
        a.observe(value)
    a.observe(0.004)
    observe_repeated(b, value, 7)
    observe_repeated(b, 0.004, 1)

    def samples(registry: CollectorRegistry) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
                if not s.name.endswith("_created")}

    got, want = samples(at_once), samples(one_by_one)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k]) for k in want)


def test_final_output_carries_the_request_latency_figures(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=3), stream=False)
    final = feed(loop, state, "abc")[-1][0]
    m = final.metrics
    assert (m.ttft_s, m.decode_s, m.tpot_s, m.queued_s) == pytest.approx((1.0, 2.0, 1.0, 0.25))


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(loop, stream) -> None:
    # max_tokens=2, stop=["00"]: the length limit and the stop string end at the same token; the stop
    # string wins (text "", finish "stop"), as in OpenAI and vLLM.
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=2, stop=("00",)), stream=stream)
    outs = [o for step in feed(loop, state, "00") for o in step]
    final = outs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("", "stop", "00")
    assert "".join(o.outputs[0].delta_text for o in outs) == ""
    assert final.token_ids == list(b"00")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked(loop, stream, include) -> None:
    # skip_special_tokens=False would show <|endoftext|>; the token that stopped the request stays
    # out of the text unless include_stop_str_in_output (vLLM's rule), but stays in token_ids.
    params = SamplingParams(temperature=0.0, max_new_tokens=8, skip_special_tokens=False, include_stop_str_in_output=include)
    state = loop.add("x", params, stream=stream)
    outs = [loop.step(state, {0: t}) for t in (*b"ab", EOS)]
    final = outs[-1][-1].outputs[0]
    want = "ab<|endoftext|>" if include else "ab"
    assert (final.text, final.finish_reason, final.stop_reason, final.token_ids) == (want, "stop", EOS,
                                                                                    [*b"ab", EOS])
    if stream:
        assert "".join(o.outputs[0].delta_text for step in outs for o in step) == want


def test_a_stop_token_ids_text_is_left_out_too(loop) -> None:
    state = loop.add("x", SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(ord("!"),)), stream=True)
    outs = [o for step in feed(loop, state, "ab!") for o in step]
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text == "ab"
    assert outs[-1].outputs[0].stop_reason == ord("!")
