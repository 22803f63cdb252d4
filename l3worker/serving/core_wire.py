"""The wire between API servers and the engine-core process(es): msgpack arrays over ZeroMQ ipc://.
Each API server connects to every engine core (`--data-parallel-size`) alike.

Control socket (each API server's DEALER, identity `api-<i>`, to the core's ROUTER):
  in:  ["hello"]                       -> ["ready", healthy, cpu layout, why, weight_version, step core]
                                       once the engine runs (step core: DistributedWorker.step_core)
       ["add", request_id, prompt_ids, params] (accepted silently; refused -> ["refused", id, kind, text])
       ["abort", request_id]
       ["metrics", seq]                -> ["metrics", seq, metric families (l3worker.engine.metrics.families_to_wire)]
       ["control", seq, name, args]    -> ["control", seq, ok, result dict or error text, error kind or None]
                                       a rollout control (l3worker/serving/controls.py: sleep, wake_up,
                                       update_weights_from_disk, pause_generation, ...), run off the core's
                                       main thread; the result carries the weight_version after it; the
                                       error kind is one of ERROR_KINDS ("error": anything else, a 500)
       ["shutdown"]                    (the launching API server, when it stops)
  out: ["health", healthy, why]        whenever the engine's health changes (a restart begins or ends);
                                       `why` says what a refused request's 503 says, None when healthy
       ["weight_version", version]     to every API server whenever a control changed it (before the reply)
Outputs socket (the core's PUSH to each API server's PULL), written by the step loop only:
  ["out", [output, ...]]               ONE message per step per API server with requests that advanced
  ["dead", text]                       the engine stopped after a failure

A streamed output carries no prompt: the API server sent the prompt's ids and fills them in (a
delta would otherwise carry the whole prompt every step). Detokenization and stop strings stay in
the engine core, so outputs cross as text plus token ids, and the API server only relays them.
"""
from __future__ import annotations

from dataclasses import fields

import msgpack

from l3worker.engine.step_loop import EngineDeadError
from l3worker.errors import EngineAsleepError, EngineBusyError, WorkerError
from l3worker.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprob

# A refusal's or a control's error, by kind; the first class an error is an instance of names it
# (subclasses first: the API answers an asleep engine, a full queue and a failure apart).
ERROR_KINDS: dict[str, type[Exception]] = {"asleep": EngineAsleepError, "busy": EngineBusyError,
                                           "dead": EngineDeadError, "failed": WorkerError, "value": ValueError,
                                           "type": TypeError}
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


def error_kind(exc: BaseException) -> str:
    return next((kind for kind, cls in ERROR_KINDS.items() if isinstance(exc, cls)), "error")


def error_from_wire(kind: str, text: str) -> Exception:
    return ERROR_KINDS.get(kind, RuntimeError)(text)


def identity(index: int) -> bytes:
    """The control socket identity of API server `index`."""
    return f"api-{index}".encode()


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False)


# -- sampling parameters ---------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> list:
    values = [getattr(params, name) for name in _PARAM_FIELDS]
    spec = params.structured_outputs
    values[_PARAM_FIELDS.index("structured_outputs")] = None if spec is None else [spec.kind, spec.value, spec.field]
    return values


def params_from_wire(values: list) -> SamplingParams:
    kwargs = dict(zip(_PARAM_FIELDS, values))
    spec = kwargs["structured_outputs"]
    if spec is not None:
        from l3worker.structured.specs import StructuredSpec

        kwargs["structured_outputs"] = StructuredSpec(*spec)
    return SamplingParams(**kwargs)


# -- outputs ---------------------------------------------------------------------------------------
def _lp(entry: TokenLogprob | None) -> list | None:
    return None if entry is None else [entry.token_id, entry.logprob, entry.top]


def _lps(entries: list | None) -> list | None:
    return None if entries is None else [_lp(e) for e in entries]


def _from_lp(entry: list | None) -> TokenLogprob | None:
    return None if entry is None else TokenLogprob(entry[0], entry[1], tuple(tuple(t) for t in entry[2]))


def _from_lps(entries: list | None) -> list | None:
    return None if entries is None else [_from_lp(e) for e in entries]


def output_to_wire(out: RequestOutput) -> list:
    samples = [[s.index, s.delta_token_ids, s.delta_text, s.finish_reason, s.stop_reason, _lps(s.delta_logprobs),
                *((s.token_ids, s.text, _lps(s.logprobs)) if out.finished else ())] for s in out.outputs]
    m = out.metrics
    return [out.request_id, out.finished, samples, out.num_cached_tokens, _lps(out.prompt_logprobs),
            None if m is None else [m.ttft_s, m.decode_s, m.tpot_s, m.queued_s], out.error,
            out.prompt if out.finished else None]


def output_from_wire(item: list, prompt_ids: list[int]) -> RequestOutput:
    request_id, finished, samples, cached, prompt_lps, metrics, error, prompt = item
    outputs = []
    for s in samples:
        c = CompletionOutput(index=s[0], delta_token_ids=s[1], delta_text=s[2], finish_reason=s[3], stop_reason=s[4],
                             delta_logprobs=_from_lps(s[5]))
        if finished:
            c.token_ids, c.text, c.logprobs = s[6], s[7], _from_lps(s[8])
        outputs.append(c)
    return RequestOutput(request_id, prompt, prompt_ids, outputs, finished=finished,
                         prompt_logprobs=_from_lps(prompt_lps), num_cached_tokens=cached,
                         metrics=None if metrics is None else RequestMetrics(*metrics), error=error)
