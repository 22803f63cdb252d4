"""l3worker.LLM: the same tokens as DistributedWorker, vLLM's defaults and seeding, its arguments
mapped or refused by name, its inputs and outputs, and nothing left behind by close() or exit."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from chip_child.models.tiny_model import ensure_tiny_model
from fault_helpers import alive, assert_nothing_left, shm_entries, wait_for
from l3worker import LLM, DistributedWorker, SamplingParams, TokensPrompt, WorkerError

OPTIONS = dict(max_num_seqs=4, max_model_len=256, enforce_eager=True)  # vLLM's names
WORKER_OPTIONS = dict(max_batch_size=4, max_seq_len=256, decode_graphs=False)  # the same, DistributedWorker's
TEXTS = ["Hello, my name is", "The capital of France is"]
IDS = [[72, 101, 108, 108, 111], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def llm():
    with LLM(**OPTIONS) as llm:
        yield llm


def test_engine_arguments_reach_the_worker(llm) -> None:
    cfg = llm.worker.runtime_config
    assert (cfg.max_batch_size, cfg.max_seq_len, cfg.decode_graphs) == (4, 256, False)
    assert llm.worker.model_dir == str(ensure_tiny_model())  # LLM() / LLM(model=None): the built-in model


def test_greedy_generate_matches_distributed_worker(llm) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [*TEXTS, TokensPrompt(prompt_token_ids=IDS[0]), IDS[1]]
    got = llm.generate(prompts, greedy, use_tqdm=False)
    with DistributedWorker(**WORKER_OPTIONS) as w:
        want = w.generate([*TEXTS, *IDS], greedy)
        default = w.generate([*TEXTS, *IDS])  # DistributedWorker keeps its greedy default, 16 tokens
        explicit = w.generate([*TEXTS, *IDS], SamplingParams(temperature=0.0, max_tokens=16))
    for g, x in zip(got, want):
        assert g.prompt_token_ids == x.prompt_token_ids
        assert g.outputs[0].token_ids == x.outputs[0].token_ids and len(g.outputs[0].token_ids) == 12
        assert g.outputs[0].text == x.outputs[0].text
    assert [o.prompt for o in got] == [*TEXTS, None, None]  # vLLM: no text for a token prompt
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in explicit]


def test_llm_defaults_are_vllms_and_seeded(llm) -> None:
    assert llm.get_default_sampling_params() == SamplingParams()  # the built-in model's config sets none
    assert (SamplingParams().temperature, SamplingParams().max_tokens) == (1.0, 16)
    outs = llm.generate(["Once upon a time"] * 4, use_tqdm=False)
    greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0), use_tqdm=False)[0]
    # Sampled, each request with a seed of its own: four samples of one prompt are not all alike,
    # and not all greedy.
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(samples)) > 1 and set(samples) != {tuple(greedy.outputs[0].token_ids)}
    assert all(len(s) <= 16 for s in samples)


def test_seed_repeats_a_run_and_close_or_collection_leaves_nothing() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    shm_before = shm_entries()
    with LLM(seed=3, **OPTIONS) as llm:
        children = [psutil.Process(p) for p in llm.worker.child_pids]
        socket_dir = llm.worker.socket_dir
        first = [o.outputs[0].token_ids for o in llm.generate(TEXTS * 2, params, use_tqdm=False)]
    assert_nothing_left(children, socket_dir, shm_before)
    with pytest.raises(WorkerError, match="closed"):
        llm.generate(TEXTS, params)
    llm.close()  # idempotent

    llm = LLM(seed=3, **OPTIONS)
    children = [psutil.Process(p) for p in llm.worker.child_pids]
    socket_dir = llm.worker.socket_dir
    second = [o.outputs[0].token_ids for o in llm.generate(TEXTS * 2, params, use_tqdm=False)]
    del llm  # no close(): the finalizer stops the worker when the LLM is collected
    gc.collect()
    assert_nothing_left(children, socket_dir, shm_before)
    assert first == second  # vLLM's seed: the same program samples the same tokens
    assert first[0] != first[2]  # while two requests for one prompt draw different seeds


def test_exit_without_close_leaves_nothing(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import json, sys
        from l3worker import LLM, SamplingParams
        llm = LLM(max_num_seqs=2, max_model_len=128)
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        print(json.dumps({"pids": llm.worker.child_pids, "socket_dir": llm.worker.socket_dir}), flush=True)
        sys.exit(0)  # no close(): the finalizer stops the worker at exit
    """)
    shm_before = shm_entries()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["pids"] and info["socket_dir"]
    assert wait_for(lambda: not any(map(_running, info["pids"]))), f"chip-children still running: {info['pids']}"
    assert not os.path.exists(info["socket_dir"]) and not (shm_entries() - shm_before)


def _running(pid: int) -> bool:
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def test_generation_config_gives_the_defaults(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_model(), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "do_sample": True}))
    with LLM(str(model), **OPTIONS) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=5)
        out = llm.generate(IDS[0], use_tqdm=False)[0]  # no SamplingParams: these defaults
        chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0]
    assert 1 <= len(out.outputs[0].token_ids) <= 5 and 1 <= len(chat.outputs[0].token_ids) <= 5
    assert out.outputs[0].finish_reason == "length" or out.outputs[0].token_ids[-1] == config["eos_token_id"]


def test_max_tokens_none_fills_the_sequence(llm) -> None:
    prompt = list(range(1, 250))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - 249 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_seq_len=256"):
        llm.generate([list(range(1, 257))], SamplingParams(max_tokens=None), use_tqdm=False)


def test_outputs_carry_vllms_fields(llm) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), SamplingParams(temperature=0.0, max_tokens=3)]
    with_lp, without = llm.generate(TEXTS, params, use_tqdm=False)
    assert isinstance(with_lp.request_id, str) and with_lp.request_id != without.request_id
    assert with_lp.prompt_logprobs is None and with_lp.finished and with_lp.metrics is not None
    sample = with_lp.outputs[0]
    assert len(sample.logprobs) == 4 and sample.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in sample.logprobs))
    assert sample.cumulative_logprob < 0 and without.outputs[0].cumulative_logprob is None
    assert (sample.index, sample.finish_reason, sample.stop_reason) == (0, "length", None)


def test_bad_input_is_refused_by_name(llm) -> None:
    cases = [
        (lambda: llm.generate(TEXTS, [SamplingParams()]), ValueError, "1 SamplingParams for 2 prompts"),
        (lambda: llm.generate({"prompt_token_ids": [1], "multi_modal_data": {}}), ValueError, "multi_modal_data"),
        (lambda: llm.generate({"prompt_tokens": [1]}), ValueError, "prompt_tokens"),
        (lambda: llm.generate(TEXTS, lora_request=object()), TypeError, "lora_request must be a LoRARequest"),
        (lambda: llm.generate(TEXTS, "greedy"), TypeError, "sampling_params"),
        (lambda: llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), ValueError,
         r"messages\[0\]\['content'\]\[0\].*image_url"),
        (lambda: llm.chat([{"role": "user", "content": "x"}], continue_final_message=True), ValueError,
         "continue_final_message"),
        (lambda: llm.chat([{"role": "user", "content": "x"}], chat_template_content_format="xml"), ValueError,
         "chat_template_content_format"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert llm.generate(TEXTS, SamplingParams(max_tokens=1), use_tqdm=False)  # still serving


@pytest.mark.parametrize("kwargs,match", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported"),
    (dict(swap_space=8), "swap_space=8 is not supported"),
    (dict(worker_cls="my.Worker"), "worker_cls is not supported"),
    (dict(tokenizer="some/other-tokenizer"), "tokenizer="),
    (dict(max_num_seqs=4, max_batch_size=8), "max_num_seqs and max_batch_size both set max_batch_size"),
    (dict(seed=-3), "seed"),
    (dict(generation_config="/nonexistent/folder"), "generation_config"),
], ids=["pipeline parallel", "swap space", "unknown", "other tokenizer", "both names", "seed", "generation_config"])
def test_unsupported_arguments_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)
