"""RL rollouts on DistributedWorker: sleep and wake, new weights from disk and from tensors,
pause and resume, with real chip-children on the cpu. Tokens are checked against transformers on
the checkpoint that should be running, memory against the children's and the parent's resident
size, and every refusal by its message."""
from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from fault_helpers import guard
from parity import hf_greedy
from l3worker import DistributedWorker, SamplingParams, WorkerError
from l3worker.errors import EngineAsleepError

KW = {"device": "cpu", "max_batch_size": 4, "max_seq_len": 128, "page_size": 8, "num_threads": 1}
PROMPTS = [[1, 2, 3, 4, 5, 6], [200, 17, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def reset_peak(pid: int) -> None:
    """From here on VmHWM measures this stretch's peak resident size (Linux's clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def pair(make_checkpoint) -> tuple[Path, Path]:
    """Two checkpoints of one architecture with different weights."""
    return make_checkpoint("rollout-a", seed=0), make_checkpoint("rollout-b", seed=1)


def test_sleep_level_1_frees_the_kv_cache_and_wake_gives_identical_tokens(pair) -> None:
    a, _ = pair
    kv_bytes = 2 * 2 * 2 * 24 * 4 * 8 * 4000  # layers, K and V, kv heads, head_dim, fp32, page size, pages
    with guard(), DistributedWorker(str(a), num_pages=4000, enable_sleep_mode=True, **KW) as w:
        before = tokens(w.generate(PROMPTS, GREEDY))
        child = w.child_pids[0]
        resident = rss(child)
        slept = w.sleep(level=1)
        assert w.is_sleeping and slept["level"] == 1
        assert slept["freed_bytes"] >= kv_bytes * 0.9 and resident - rss(child) >= kv_bytes * 0.9
        with pytest.raises(EngineAsleepError, match="wake_up"):
            w.generate(PROMPTS, GREEDY)
        woke = w.wake_up()
        assert not w.is_sleeping and woke["restored_bytes"] >= kv_bytes * 0.9
        assert tokens(w.generate(PROMPTS, GREEDY)) == before
        w.sleep(1)
        w.wake_up(["kv_cache"])  # level 1 on the cpu leaves the weights where they are: one tag suffices
        assert not w.is_sleeping and tokens(w.generate(PROMPTS, GREEDY)) == before


def test_sleep_is_refused_by_name_without_sleep_mode_with_requests_running_or_a_bad_level(pair) -> None:
    a, _ = pair
    with guard():
        with DistributedWorker(str(a), **KW) as w, pytest.raises(ValueError, match="enable_sleep_mode"):
            w.sleep()
        with DistributedWorker(str(a), enable_sleep_mode=True, **KW) as w:
            with pytest.raises(ValueError, match="level must be 1 or 2"):
                w.sleep(3)
            with pytest.raises(ValueError, match="tags must be"):
                w.wake_up(["optimizer"])
            stream = w.stream(PROMPTS, GREEDY)
            next(stream)
            with pytest.raises(ValueError, match="2 requests are unfinished"):
                w.sleep()
            assert len(list(stream)) > 0 and not w.is_sleeping  # refused: the requests went on
            assert w.healthy


def test_level_2_then_an_update_from_disk_gives_the_new_checkpoints_transformers_tokens(pair, hf_model) -> None:
    a, b = pair
    want = [hf_greedy(hf_model(b), p, GREEDY.max_tokens) for p in PROMPTS]
    with guard(), DistributedWorker(str(a), enable_sleep_mode=True, **KW) as w:
        assert tokens(w.generate(PROMPTS, GREEDY)) != want
        w.sleep(level=2)
        assert w.wake_up()["weights_need_update"]
        with pytest.raises(EngineAsleepError, match="update them first"):
            w.generate(PROMPTS, GREEDY)
        assert w.update_weights_from_disk(str(b), weight_version="step-1") == {"weight_version": "step-1"}
        assert w.weight_version == "step-1"
        assert tokens(w.generate(PROMPTS, GREEDY)) == want
        # a restart loads what is running now, not the checkpoint the worker started with
        os.kill(w.child_pids[0], 9)
        assert tokens(w.generate(PROMPTS, GREEDY)) == want
        assert w.engine.restarts.total == 1


def test_a_bucketed_tensor_update_splits_layers_and_needs_no_second_copy_of_the_model(make_checkpoint,
                                                                                      hf_model) -> None:
    shape = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
             "head_dim": 64}
    a, b = make_checkpoint("rollout-big-a", seed=0, **shape), make_checkpoint("rollout-big-b", seed=1, **shape)
    # A trainer's tensors live in its memory: cloned, so reading them maps no file pages in meanwhile.
    new = {name: t.clone() for name, t in load_file(str(b / "model.safetensors")).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    want = [hf_greedy(hf_model(b), p, GREEDY.max_tokens) for p in PROMPTS]
    with guard(), DistributedWorker(str(a), **KW) as w:
        w.generate(PROMPTS, GREEDY)
        pid = w.child_pids[0]
        child, parent = rss(pid), rss(os.getpid())
        reset_peak(pid), reset_peak(os.getpid())
        bucket = model_bytes // 7  # buckets that cut layers in two
        result = w.update_weights_from_tensor(new, bucket_bytes=bucket)
        grew = peak(pid) - child, peak(os.getpid()) - parent
        print(f"model {model_bytes >> 20} MiB, bucket {bucket >> 20} MiB: peak growth child {grew[0] >> 20} MiB, "
              f"parent {grew[1] >> 20} MiB")
        assert result == {"weight_version": "1", "pending_tensors": []}
        assert tokens(w.generate(PROMPTS, GREEDY)) == want
        # In place: neither process held a second model at any moment. The parent holds one bucket;
        # the child a bucket and a layer, plus, on the cpu, the heap that re-packing oneDNN matrices
        # leaves behind the first time (about 0.6x of the model here; a second update reuses it).
        assert grew[1] < model_bytes / 4 and grew[0] < model_bytes
        assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"l3worker-weights-{os.getpid()}-")]


def test_a_layer_split_over_calls_waits_for_its_rest_and_flush_names_what_never_came(pair, hf_model) -> None:
    a, b = pair
    new = load_file(str(b / "model.safetensors"))
    first = {n: t for n, t in new.items() if "mlp" not in n}
    rest = {n: t for n, t in new.items() if "mlp" in n}
    with guard(), DistributedWorker(str(a), **KW) as w:
        start = tokens(w.generate(PROMPTS, GREEDY))
        with pytest.raises(ValueError, match=r"missing \[.*model\.layers\.0\.mlp\.down_proj\.weight"):
            w.update_weights_from_tensor(first)
        pending = w.update_weights_from_tensor(first, flush=False)["pending_tensors"]
        assert sorted(pending) == sorted(n for n in first if n.startswith("model.layers."))
        assert w.update_weights_from_tensor(rest)["pending_tensors"] == []
        assert tokens(w.generate(PROMPTS, GREEDY)) == [hf_greedy(hf_model(b), p, 12) for p in PROMPTS] != start


def test_another_architecture_is_refused_naming_the_tensor_and_the_worker_goes_on(pair, make_checkpoint) -> None:
    a, _ = pair
    other = make_checkpoint("rollout-wide", seed=2, intermediate_size=128)
    rope = make_checkpoint("rollout-rope", seed=2, rope_theta=5000.0)
    with guard(), DistributedWorker(str(a), **KW) as w:
        before = tokens(w.generate(PROMPTS, GREEDY))
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\]"):
            w.update_weights_from_disk(str(other))
        with pytest.raises(ValueError, match="rope_theta=5000.0"):
            w.update_weights_from_disk(str(rope))
        with pytest.raises(ValueError, match="no tensor 'model.layers.9.mlp.up_proj.weight'"):
            w.update_weights_from_tensor({"model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)})
        with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[3\]"):
            w.update_weights_from_tensor({"model.norm.weight": torch.zeros(3)})
        assert w.weight_version == "default"
        assert tokens(w.generate(PROMPTS, GREEDY)) == before


def test_pause_keep_update_and_continue_gives_old_weights_prefix_and_new_weights_suffix(pair, hf_model) -> None:
    """The held request keeps its K/V: the oracle runs the old model over what it had, then the
    new model on from there with that cache."""
    a, b = pair
    prompt, n = PROMPTS[0], 16
    with guard(), DistributedWorker(str(a), **KW) as w:
        stream = w.stream([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        seen = 0
        for out in stream:
            seen += len(out.outputs[0].delta_token_ids)
            if seen >= 3:
                break
        assert w.pause_generation("keep") == 1 and w.is_paused
        state = next(iter(w.engine.requests.values()))
        k = len(state.seqs[0].tokens)  # every step sent before the pause completed
        w.update_weights_from_disk(str(b))
        w.continue_generation()
        final = [o for o in stream if o.finished][0]
    got = final.outputs[0].token_ids
    old, new = hf_model(a), hf_model(b)
    with torch.no_grad():
        out = old(torch.tensor([prompt + got[:k - 1]]), use_cache=True)
        want, last = list(got[:k]), got[k - 1]
        while len(want) < n:
            out = new(torch.tensor([[last]]), cache=out.cache, use_cache=True)
            last = int(out.logits[0, -1].argmax())
            want.append(last)
    assert k < n and got == want
    assert hf_greedy(old, prompt, n) != got != hf_greedy(new, prompt, n)


def test_pause_abort_ends_the_running_requests_and_new_ones_wait_for_continue(pair) -> None:
    a, _ = pair
    with guard(), DistributedWorker(str(a), **KW) as w:
        stream = w.stream(PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        next(stream)
        assert w.pause_generation("abort") == 2
        finals = [o for o in stream if o.finished]
        assert {o.outputs[0].finish_reason for o in finals} == {"abort"}
        assert all(len(o.outputs[0].token_ids) < 60 for o in finals)
        with pytest.raises(ValueError, match="mode must be one of"):
            w.pause_generation("later")
        w.continue_generation()
        assert not w.is_paused and len(tokens(w.generate(PROMPTS, GREEDY))[0]) == 12


def test_a_restart_after_a_tensor_update_is_refused_by_name(pair) -> None:
    a, b = pair
    with guard(), DistributedWorker(str(a), **KW) as w:
        w.update_weights_from_tensor(load_file(str(b / "model.safetensors")))
        os.kill(w.child_pids[0], 9)
        with pytest.raises(WorkerError, match="update_weights_from_tensor"):
            w.generate(PROMPTS, GREEDY)


def test_seeded_rollouts_give_the_same_tokens_at_batch_1_and_batch_16(pair) -> None:
    a, _ = pair
    prompts = [[3 + i, 40 + i, 7] for i in range(16)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=100 + i) for i in range(16)]
    with guard(), DistributedWorker(str(a), **{**KW, "max_batch_size": 16}) as w:
        together = tokens(w.generate(prompts, params))
        alone = [tokens(w.generate([p], q))[0] for p, q in zip(prompts, params)]
    assert together == alone and len({tuple(t) for t in together}) > 1


def test_the_offline_llm_sleeps_wakes_and_takes_new_weights_as_vllms_does(pair, hf_model) -> None:
    from l3worker import LLM

    a, b = pair
    with guard(), LLM(str(a), enable_sleep_mode=True, max_model_len=128, max_num_seqs=4, device="cpu",
                      num_threads=1) as llm:
        before = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False))
        llm.sleep(level=1)
        llm.wake_up()
        assert llm.reset_prefix_cache()
        assert tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)) == before
        llm.update_weights_from_disk(str(b))
        after = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False))
    assert after == [hf_greedy(hf_model(b), p, 12) for p in PROMPTS]


def test_tensor_parallel_ranks_load_their_shards_of_the_new_weights(make_checkpoint, hf_model) -> None:
    a = make_checkpoint("rollout-tp-a", seed=0, num_attention_heads=8, num_key_value_heads=2)
    b = make_checkpoint("rollout-tp-b", seed=1, num_attention_heads=8, num_key_value_heads=2)
    want = [hf_greedy(hf_model(b), p, 12) for p in PROMPTS]
    with guard(), DistributedWorker(str(a), **{**KW, "device_ids": (0, 1)}) as w:
        assert tokens(w.generate(PROMPTS, GREEDY)) != want
        w.update_weights_from_disk(str(b))
        assert tokens(w.generate(PROMPTS, GREEDY)) == want
        w.update_weights_from_tensor(load_file(str(a / "model.safetensors")))
        assert tokens(w.generate(PROMPTS, GREEDY)) == [hf_greedy(hf_model(a), p, 12) for p in PROMPTS]
