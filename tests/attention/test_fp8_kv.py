"""The fp8 KV cache (kv_cache_dtype="fp8"): twice the tokens of bf16 in the same memory, one
rounding of K/V that every read sees (so chunking, prefix-cache hits and preemption give the
tokens an unchunked run gives), log-probabilities close to the model dtype's, and the backends
that cannot read it refused by name."""
from __future__ import annotations

import pytest
import torch

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams
from l3worker.worker.arg_checks import check_kv_cache_dtype

KW = {"device": "cpu", "max_seq_len": 256, "page_size": 8, "num_threads": 1}
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(3, 30)) + [7, 7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_fp8_pages_hold_twice_the_tokens_of_bf16_in_the_same_memory(make_checkpoint) -> None:
    path = str(make_checkpoint())
    pages = {kv: DistributedWorker(path, dtype="bfloat16", gpu_memory_utilization=0.02, kv_cache_dtype=kv,
                                   **KW).kv_sizing.num_pages for kv in ("auto", "fp8")}
    assert abs(pages["fp8"] - 2 * pages["auto"]) <= 2, pages  # the same bytes for pages, after the same weights


def test_one_rounding_every_read_sees_gives_identical_tokens_however_steps_are_made(make_checkpoint) -> None:
    path = str(make_checkpoint())
    with guard(), DistributedWorker(path, kv_cache_dtype="fp8", max_batch_size=4, **KW) as w:
        want = [tokens(w.generate([p], GREEDY))[0] for p in PROMPTS]  # alone, whole prompts
    # chunked prefill, a tiny pool (preemptions), a shared prefix found in the cache, run-ahead 2
    with guard(), DistributedWorker(path, kv_cache_dtype="fp8", max_batch_size=3, num_pages=14,
                                    max_num_batched_tokens=9, **KW) as w:
        got = tokens(w.generate(PROMPTS, GREEDY))
        assert w.engine.scheduler.num_preemptions > 0
        assert w.engine.metrics.value("l3worker:prefix_cache_hits_total") > 0
    assert got == want


def test_fp8_log_probabilities_stay_close_to_the_model_dtypes(make_checkpoint) -> None:
    path = str(make_checkpoint())
    prompt = list(range(3, 120))
    scored = {}
    for kv in ("auto", "fp8"):
        with guard(), DistributedWorker(path, kv_cache_dtype=kv, max_batch_size=2, **KW) as w:
            out = w.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
            scored[kv] = [lp for lp in out.prompt_logprobs if lp is not None]
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(scored["auto"], scored["fp8"])]
    assert 0 < max(diffs) < 0.1  # rounded (not the same cache), and close


def test_the_triton_backend_passes_its_self_check_on_fp8_and_gives_the_torch_backends_tokens(make_checkpoint) -> None:
    path = str(make_checkpoint())
    prompts = [p[:12] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = {}
    kw = {**KW, "device": "cuda" if torch.cuda.is_available() else "cpu"}  # triton interpreted on the cpu
    for backend in ("torch", "triton"):
        with guard(), DistributedWorker(path, kv_cache_dtype="fp8", attention_backend=backend, max_batch_size=3,
                                        **kw) as w:
            got[backend] = tokens(w.generate(prompts, params))
            assert w.stats()["attention_backend"] == backend  # triton passed its self-check on an fp8 cache
    assert got["triton"] == got["torch"]


def test_backends_that_cannot_read_fp8_and_unknown_dtypes_are_refused_by_name(make_checkpoint) -> None:
    path = str(make_checkpoint())
    with pytest.raises(ValueError, match="kv_cache_dtype: an fp8 cache is read by the torch, cpu and triton "
                                         "attention backends only so far, and this device's is 'npu'"):
        check_kv_cache_dtype(torch.float8_e4m3fn, "npu")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3'\)"):
        DistributedWorker(path, kv_cache_dtype="fp8_e5m2", **KW)
