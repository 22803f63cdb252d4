"""LoRA through what moves rows around: preemption (a tiny KV pool), chunked prefill, a
chip-child restart (every request resumed, the adapters loaded again), tensor parallel over two
cpu children (A and B sharded like their layers), and adapters added and removed while streams
run. Each gives the tokens of a plain run."""
from __future__ import annotations

import threading

import pytest

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams
from l3worker.lora import LoRARequest
from lora_adapters import write_adapter

KW = {"device": "cpu", "max_seq_len": 128, "page_size": 8, "num_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(3, 30)), list(range(40, 52)), [5, 9, 2, 7] * 6, list(range(60, 85))]


@pytest.fixture(scope="module")
def setup(make_checkpoint, tmp_path_factory):
    base = make_checkpoint()
    root = tmp_path_factory.mktemp("adapters")
    paths = [write_adapter(base, root / f"a{i}", seed=10 + i, r=4) for i in range(2)]
    requests = [LoRARequest("a0", 1, str(paths[0])), None, LoRARequest("a1", 2, str(paths[1])),
                LoRARequest("a0", 1, str(paths[0]))]
    with guard(), DistributedWorker(str(base), enable_lora=True, max_loras=2, max_batch_size=4, **KW) as w:
        want = [o.outputs[0].token_ids for o in w.generate(PROMPTS, GREEDY, lora_request=requests)]
    return str(base), requests, want


def run(setup, **kw) -> list[list[int]]:
    base, requests, _ = setup
    with guard(), DistributedWorker(base, enable_lora=True, max_loras=2, **{**KW, **kw}) as w:
        outs = w.generate(PROMPTS, GREEDY, lora_request=requests)
        if kw.get("num_pages"):
            assert w.engine.scheduler.num_preemptions > 0
        return [o.outputs[0].token_ids for o in outs]


def test_preemption_and_chunked_prefill_keep_each_rows_adapter(setup) -> None:
    assert run(setup, max_batch_size=4, num_pages=8, max_num_batched_tokens=16) == setup[2]


def test_a_restarted_child_reloads_the_adapters_and_resumes_every_request(setup) -> None:
    assert run(setup, max_batch_size=4, fault_injection="exit@6") == setup[2]


def test_tensor_parallel_shards_the_adapters_like_their_layers(setup) -> None:
    assert run(setup, max_batch_size=4, device_ids=(0, 1)) == setup[2]


def test_adapters_load_and_unload_while_streams_run(setup) -> None:
    base, requests, want = setup
    with guard(), DistributedWorker(base, enable_lora=True, max_loras=2, max_batch_size=4, **KW) as w:
        w.add_lora(requests[0])
        stream = w.stream(PROMPTS[:2], GREEDY, lora_request=requests[:2])
        first = next(stream)
        assert w.add_lora(requests[2])  # while the stream runs
        finals = {o.request_id: o for o in [first, *stream] if o.finished}
        got = [finals[k].outputs[0].token_ids for k in sorted(finals, key=int)]
        assert got == want[:2]
        assert w.remove_lora(1) and w.list_loras() == {2}
        assert [o.outputs[0].token_ids for o in w.generate([PROMPTS[2]], GREEDY, lora_request=requests[2])] \
            == [want[2]]
        remover = threading.Thread(target=w.remove_lora, args=(2,))  # from another thread, as a server's
        remover.start()
        remover.join()
        assert w.list_loras() == set()
