"""LoRA adapters offline (l3worker.lora, chip_child.models.lora): greedy tokens per adapter equal
transformers with peft's adapter applied, and logits agree in fp32; a batch mixing the base model
and three adapters gives each what it gives alone; the prefix cache never serves one adapter's
pages to another or to the base; more adapters than slots take turns; bad adapters are refused by
name and leave the worker usable."""
from __future__ import annotations

import json

import pytest

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams
from l3worker.lora import LoRARequest
from lora_adapters import peft_model, write_adapter
from parity import hf_greedy

KW = {"device": "cpu", "max_seq_len": 128, "page_size": 8, "num_threads": 1, "max_batch_size": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(3, 30)), list(range(40, 52)), [5, 9, 2, 7] * 6]


@pytest.fixture(scope="module")
def base(make_checkpoint):
    return make_checkpoint()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_adapter(base, root / "all", seed=1, r=4),
        "attn": write_adapter(base, root / "attn", seed=2, r=8, alpha=4, targets=["q_proj", "v_proj"]),
        "rslora": write_adapter(base, root / "rslora", seed=3, r=2, alpha=16, use_rslora=True,
                                targets=["o_proj", "down_proj", "gate_proj"]),
    }


@pytest.fixture(scope="module")
def worker(base):
    """One worker for the tests that need no other settings: three slots, rank up to 8."""
    with DistributedWorker(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, **KW) as w:
        yield w


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_tokens_per_adapter_equal_transformers_with_peft(base, adapters, worker) -> None:
    with guard():
        for i, (name, path) in enumerate(adapters.items()):
            got = tokens(worker.generate(PROMPTS, GREEDY, lora_request=LoRARequest(name, i + 1, str(path))))
            model = peft_model(base, path)
            assert got == [hf_greedy(model, p, 10) for p in PROMPTS], name
        plain = tokens(worker.generate(PROMPTS, GREEDY))
    assert plain != got  # the adapters change the model


def test_logprobs_with_an_adapter_match_peft_in_fp32(base, adapters, worker) -> None:
    import torch

    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with guard():
        out = worker.generate([prompt], params, lora_request=LoRARequest("all", 1, str(adapters["all"])))[0]
    model = peft_model(base, adapters["all"])
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    ref = [want[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


def test_a_batch_mixing_the_base_and_three_adapters_equals_each_alone(adapters, worker) -> None:
    requests = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
    with guard():
        alone = [tokens(worker.generate([p], GREEDY, lora_request=r))[0] for p, r in zip(prompts, requests)]
        worker.reset_prefix_cache()
        mixed = tokens(worker.generate(prompts, GREEDY, lora_request=requests))
        assert worker.loras.loads >= 3
    assert mixed == alone


def test_more_adapters_than_slots_take_turns_with_identical_tokens(base, adapters, worker) -> None:
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(requests))]
    with guard():
        want = tokens(worker.generate(prompts, GREEDY, lora_request=requests))
    with guard(), DistributedWorker(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                                    **KW) as w:
        got = tokens(w.generate(prompts, GREEDY, lora_request=requests))
        assert w.loras.loads >= 3  # one slot: each adapter loaded in turn, written again from its checkpoint
    assert got == want


def test_the_prefix_cache_is_never_shared_across_adapters_or_with_the_base(adapters, worker) -> None:
    prompt = list(range(3, 40))
    a, b = LoRARequest("all", 1, str(adapters["all"])), LoRARequest("attn", 2, str(adapters["attn"]))
    worker.reset_prefix_cache()
    with guard():
        cached = []
        for lora in (None, a, b, a, None):
            out = worker.generate([prompt], GREEDY, lora_request=lora)[0]
            cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # the base, then each adapter: nothing another wrote
    assert cached[3] == cached[4] == 32  # the same adapter again, the base again: their own pages
    # An adapter's request that computes every position (prompt log-probabilities) registers its
    # pages on its own chain too: the base model's next request finds only its own.
    fresh = list(range(50, 80))
    worker.generate([fresh], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), lora_request=a)
    after = worker.generate([fresh], GREEDY)[0]
    worker.reset_prefix_cache()
    assert after.num_cached_tokens == 0 and tokens([after]) == tokens(worker.generate([fresh], GREEDY))


def test_bad_adapters_are_refused_by_name_and_the_worker_stays_usable(base, adapters, worker, tmp_path) -> None:
    w = worker
    with guard():
        wide = write_adapter(base, tmp_path / "wide", seed=9, r=16)
        with pytest.raises(ValueError, match="rank r=16 exceeds max_lora_rank=8"):
            w.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("wide", 8, str(wide)))
        for key, value, message in [("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save"),
                                    ("target_modules", ["embed_tokens"], "embedding and lm_head"),
                                    ("peft_type", "IA3", "is not LORA")]:
            bad = tmp_path / key
            bad.mkdir()
            config = json.loads((adapters["all"] / "adapter_config.json").read_text())
            config[key] = value
            (bad / "adapter_config.json").write_text(json.dumps(config))
            (bad / "adapter_model.safetensors").write_bytes((adapters["all"] / "adapter_model.safetensors").read_bytes())
            with pytest.raises(ValueError, match=message):
                w.add_lora(LoRARequest(key, 9, str(bad)))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            w.add_lora(LoRARequest("missing", 9, str(tmp_path / "nowhere")))
        again = LoRARequest("again", 7, str(adapters["all"]))
        assert w.add_lora(again) and 7 in w.list_loras() and 8 not in w.list_loras()
        assert not w.add_lora(again)
        assert tokens(w.generate([PROMPTS[0]], GREEDY, lora_request=again))
        assert w.remove_lora(7) and not w.remove_lora(7) and 7 not in w.list_loras()
    with guard(), DistributedWorker(str(base), **KW) as w:
        with pytest.raises(ValueError, match="enable_lora=True"):
            w.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("all", 1, str(adapters["all"])))
    with pytest.raises(ValueError, match="enable_lora cannot be combined with speculative_config"):
        DistributedWorker(str(base), enable_lora=True, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 2}, **KW)


def test_vllm_offline_api_takes_lora_requests(base, adapters, worker) -> None:
    """LLM(enable_lora=True).generate(..., lora_request=LoRARequest(name, id, path)), as vLLM's."""
    from l3worker import LLM

    request = LoRARequest("all", 1, str(adapters["all"]))
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_model_len=128, device="cpu")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                             lora_request=request, use_tqdm=False)]
        assert llm.list_loras() == {1}
    finally:
        llm.worker.close()
    assert got == tokens(worker.generate(PROMPTS, GREEDY, lora_request=request))


def test_lora_requests_info_names_running_and_waiting_adapters(adapters, worker) -> None:
    """vLLM's lora_requests_info: one series whose labels list the adapters in use."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    request = LoRARequest("all", 1, str(adapters["all"]))
    with guard():
        seen = []
        for _ in worker.stream(PROMPTS, GREEDY, lora_request=[request, None, request]):
            text = generate_latest(worker.engine.metrics.registry).decode()
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "l3worker:lora_requests_info"]
            seen.append(samples[0].labels)
    assert {"max_lora": "3", "running_lora_adapters": "all", "waiting_lora_adapters": ""} in seen
    assert seen[-1]["running_lora_adapters"] == ""  # all finished


def test_an_adapter_removed_while_its_requests_wait_still_serves_them(adapters, worker) -> None:
    """remove_lora: new requests can no longer name it, those already queued run with it."""
    request = LoRARequest("late", 6, str(adapters["attn"]))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(7)]  # more than the 4 rows: some wait
    with guard():
        want = tokens(worker.generate(prompts, GREEDY, lora_request=request))
        worker.reset_prefix_cache()
        stream = worker.stream(prompts, GREEDY, lora_request=request)
        outs = [next(stream)]
        assert worker.remove_lora(6) and 6 not in worker.list_loras()
        outs += list(stream)
    finals = {o.request_id: o for o in outs if o.finished}
    assert [finals[k].outputs[0].token_ids for k in sorted(finals, key=int)] == want
    assert all(r is None or r.request.lora_int_id != 6 for r in worker.loras.slots)  # its slot freed at the end
