"""Output processing: a step's sampled tokens turned into what callers see.

Per sample: incremental detokenization with stop strings matched (a streamed delta holds back
what could still start one), log-probabilities, and latency figures. Per request: a delta for
streaming requests each step something changed, and one final output, cumulative over every
sample, once all n are done. It reads plain arrays and Sequences, never a child: the engine's
loop hands it what a step produced.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from l3worker.engine.detokenizer import SampleText
from l3worker.engine.metrics import EngineMetrics
from l3worker.params import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from l3worker.engine.requests import RequestState
from l3worker.engine.scheduler import Sequence
from l3worker.engine.stats import GenerateStats

# Ends a sequence early: (sequence, finish reason, stop reason). The scheduler's finish().
FinishSeq = Callable[[Sequence, str, "str | int | None"], None]


@dataclass
class SlotLogprobs:
    """The log-probabilities one step wrote (see l3worker.worker.shared_buffers.StepBuffers for the layout)."""

    logprobs: np.ndarray  # float32 [rows, 1 + K]: the sampled token's, then the top K
    logprob_ids: np.ndarray  # int32 [rows, K]
    prompt_logprobs: np.ndarray  # float32 [staging, 1 + K]
    prompt_logprob_ids: np.ndarray  # int32 [staging, K]


class OutputProcessor:
    def __init__(self, tokenizer, metrics: EngineMetrics, finish: FinishSeq):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.finish = finish  # a stop string ends its sequence here: its row frees before the next step
        self.requests: dict[str, RequestState] = {}  # every request added and not finished
        self.recorder: GenerateStats | None = None  # generate() collects per-request figures here
        # vLLM's: a streamed delta waits for this many new tokens (a request's own may be larger);
        # the first token and a sample's end go at once
        self.stream_interval = 1

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def process(self, advanced: Iterable[tuple[int, Sequence]], now: float, outputs: list[RequestOutput],
                logprobs: SlotLogprobs | None = None,
                scoring: Iterable[tuple[int, int, int, Sequence]] = (),
                touched: dict[str, RequestState] | None = None) -> None:
        """Takes in one step: `advanced` the (row, sequence) pairs it gave a token (or, for a scoring
        request, finished), `scoring` the prompt chunks whose log-probabilities it computed. Appends
        the outputs it produced to `outputs`; given `touched`, adds the requests with something to
        report to it instead, for the caller to report once for several steps."""
        if logprobs is not None:
            for offset, start, length, seq in scoring:
                self._take_prompt_logprobs(logprobs, offset, start, length, seq)
        report_now = touched is None
        touched = {} if touched is None else touched  # the requests with something to report
        gaps: dict[float, int] = {}
        new_tokens = 0
        requests = self.requests
        for row, seq in advanced:
            state = requests[seq.request_id]
            new_tokens += self._take_token(state, row, seq, logprobs, now, gaps)
            # A request that does not stream reports once, when a sample ends (the last one ends it).
            if state.stream or seq.finish_reason is not None:
                touched[state.request_id] = state
        self.metrics.generation_tokens.inc(new_tokens)
        self.metrics.observe_itl(gaps)
        if self.recorder is not None:
            self.recorder.generated_tokens += new_tokens
        if report_now:
            for state in touched.values():
                self.report(state, outputs)

    def _take_token(self, state: RequestState, row: int, seq: Sequence, logprobs: SlotLogprobs | None,
                    now: float, gaps: dict[float, int]) -> int:
        """Takes in the token a step gave one sample (in `row`): text, stop strings, logprobs and
        latency figures (its inter-token gap counted in `gaps`). Returns the number of tokens it
        added (0 for a scoring prefill)."""
        if not seq.tokens:  # scoring only: the prefill finished the request
            self._observe_first_token(state, seq, now)
            return 0
        token = seq.tokens[-1]
        if state.logprobs is not None:
            top_n = seq.params.logprobs
            state.logprobs[seq.index].append(
                _token_logprob(token, logprobs.logprobs[row], logprobs.logprob_ids[row], top_n))
        if len(seq.tokens) == 1:
            self._observe_first_token(state, seq, now)
        else:
            gap = now - seq.prev_token_at
            gaps[gap] = gaps.get(gap, 0) + 1
        text = state.texts[seq.index]
        if text is not None and not _stop_token_hidden(seq):
            hit = text.add(token)
            if hit is not None:
                self.finish(seq, "stop", hit)
                if seq.finish_reason == "length":
                    # The token that completed the stop string was also the last one allowed: the
                    # scheduler ended the sequence first, but the stop string is what the caller asked
                    # to end at (vLLM and OpenAI answer "stop" and leave it out).
                    seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.grammar is not None and seq.finish_reason in (None, "length"):
            verdict = seq.grammar.take(token)
            if verdict == "complete":
                # Nothing but eos could follow (and when the last allowed token completed it, the
                # reply is whole: "stop", as for a stop string).
                if seq.finished:
                    seq.finish_reason = "stop"
                else:
                    self.finish(seq, "stop", None)
            elif verdict == "refused":  # the child's mask let through what the grammar forbids
                state.error = (f"structured output: the grammar refused token {token} at output position "
                               f"{len(seq.tokens) - 1} of sample {seq.index}")
                self.metrics.grammar_failures.inc()
                if seq.finished:
                    seq.finish_reason = "abort"
                else:
                    self.finish(seq, "abort", None)
        return 1

    def _observe_first_token(self, state: RequestState, seq: Sequence, now: float) -> None:
        if state.first_token_seen:
            return
        state.first_token_seen = True
        self.metrics.ttft.observe(now - state.arrival)
        self.metrics.queue_time.observe(seq.admitted_at - state.arrival)
        self.metrics.prompt_tokens.inc(len(state.prompt_ids))

    def _take_prompt_logprobs(self, logprobs: SlotLogprobs, offset: int, start: int, length: int,
                              seq: Sequence) -> None:
        """A chunk's entry at staging offset + i holds the log-probability of the prompt token
        after position start + i, and the top N there."""
        state = self.requests.get(seq.request_id)
        if state is None:
            return  # aborted meanwhile
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None] * seq.prompt_len
        values, ids = logprobs.prompt_logprobs, logprobs.prompt_logprob_ids
        top_n = seq.params.prompt_logprobs
        for q in range(start, min(start + length, seq.prompt_len - 1)):
            row = offset + q - start
            state.prompt_logprobs[q + 1] = _token_logprob(int(seq.prompt_ids[q + 1]), values[row], ids[row], top_n)

    def report(self, state: RequestState, outputs: list[RequestOutput]) -> None:
        """Adds the request's delta (streaming) or, once every sample is done, its final output."""
        done = state.all_finished
        if not done and not state.stream:
            return
        samples = []
        for seq in state.seqs:
            i = seq.index
            sent = state.reported[i]
            if not done and not seq.finished and len(seq.tokens) - sent < (self._interval(seq) if sent else 1):
                continue
            text = state.texts[i]
            final = seq.finished
            if done and text is None and self.tokenizer is not None:
                text = SampleText(self.tokenizer, seq.params.skip_special_tokens, (), False)
                state.texts[i] = text
            if final and text is not None:
                text.finish(seq.tokens[:-1] if _stop_token_hidden(seq) else seq.tokens,
                            isinstance(seq.stop_reason, str))
            lps = state.logprobs[i] if state.logprobs is not None else None
            out = CompletionOutput(
                index=i, finish_reason=seq.finish_reason if final else None,
                stop_reason=seq.stop_reason if final else None,
                delta_token_ids=seq.tokens[sent:], delta_text=text.delta(final) if text is not None else "",
                delta_logprobs=lps[sent:] if lps is not None else None,
            )
            if done:
                out.token_ids, out.logprobs = list(seq.tokens), lps
                out.text = text.text if text is not None else None
            state.reported[i] = len(seq.tokens)
            samples.append(out)
        if done:
            state.finished = True
            self._finish_request(state)
        if samples or done:
            outputs.append(RequestOutput(
                state.request_id, state.prompt, state.prompt_token_ids, samples, finished=done,
                prompt_logprobs=state.prompt_logprobs, num_cached_tokens=state.seqs[0].num_cached_tokens,
                metrics=request_metrics(state) if done else None, error=state.error if done else None))

    def _interval(self, seq: Sequence) -> int:
        own = seq.params.stream_interval
        return self.stream_interval if own is None else max(own, self.stream_interval)

    def _finish_request(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        reason = state.seqs[0].finish_reason
        self.metrics.request_success.labels(reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - state.arrival)
        if self.recorder is not None:
            for seq in state.seqs:
                if seq.tokens:
                    self.recorder.ttft_s.append(seq.first_token_at - seq.arrival)
                if len(seq.tokens) > 1:
                    self.recorder.tpot_s.append((seq.last_token_at - seq.first_token_at) / (len(seq.tokens) - 1))


def _stop_token_hidden(seq: Sequence) -> bool:
    """True when the sequence's last token is the eos or stop token that ended it and its text stays
    out of the output (vLLM's rule: only include_stop_str_in_output shows it, whatever
    skip_special_tokens says; its id stays in token_ids)."""
    return (seq.finish_reason == "stop" and isinstance(seq.stop_reason, int)
            and not seq.params.include_stop_str_in_output)


def _token_logprob(token: int, values: np.ndarray, ids: np.ndarray, top_n: int) -> TokenLogprob:
    """One position's entry: values[0] the token's log-probability, values[1:] and ids the top N."""
    top = tuple((int(i), float(v)) for i, v in zip(ids[:top_n], values[1:1 + top_n]))
    return TokenLogprob(token, float(values[0]), top)


def request_metrics(state: RequestState) -> RequestMetrics:
    """The final output's latency figures, from the first sample."""
    seq = state.seqs[0]
    n = len(seq.tokens)
    if n == 0:
        return RequestMetrics(ttft_s=0.0, decode_s=0.0, tpot_s=0.0, queued_s=max(seq.admitted_at - seq.arrival, 0.0))
    decode_s = seq.last_token_at - seq.first_token_at
    return RequestMetrics(ttft_s=seq.first_token_at - seq.arrival, decode_s=decode_s,
                          tpot_s=decode_s / (n - 1) if n > 1 else 0.0, queued_s=seq.admitted_at - seq.arrival)
