"""Chunked prefill beside decoding rows, prefix caching and preemption, through real chip-children
and, for the numerics, through the runtime in-process against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.protocol import Admit, Chunk, Command
from chip_child.step.runtime import ChipRuntime
from l3worker import DistributedWorker, SamplingParams
from l3worker.engine import page_pool

PAGE = 8
VOCAB = 300


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("live", seed=3, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reference(ckpt, hf_model):
    """Greedy tokens of transformers for a prompt, cached."""
    model = hf_model(ckpt)
    cache: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                     pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return greedy


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


def worker(ckpt, **kw) -> DistributedWorker:
    kw = dict(max_batch_size=4, max_seq_len=256, page_size=PAGE) | kw
    return DistributedWorker(ckpt, **kw)


# -- numerics: a chunked prompt beside decoding rows, in-process ---------------------------------------

def test_chunk_logits_match_transformers_at_every_split(ckpt, hf_model) -> None:
    """A 29-token prompt prefilled in chunks that end on and off page boundaries, while another row
    decodes in the same steps: the logits of its last token and of the decoding row equal
    transformers' in fp32."""
    model = hf_model(ckpt)
    rt = ChipRuntime(RuntimeConfig(str(ckpt), device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64,
                                   page_size=PAGE, max_prefill_tokens=64))
    out = torch.zeros(2, dtype=torch.int32)
    long_prompt, short_prompt = prompts(1, [29, 5])
    for splits in ([8, 16, 29], [3, 11, 24, 29], [13, 29], [29]):
        step = 0
        # Row 1 prefills its short prompt and decodes while row 0's chunks run.
        short = [*short_prompt]
        rt.execute(Command(step, admits=[Admit(1, 5, 0.0, 1.0, 0, 0)], chunks=[Chunk(1, 0, 5, 0, True)],
                           new_pages=np.array([[1, 0, 10]], np.int32)), np.array(short, np.int32), out)
        short.append(int(out[1]))
        step += 1
        start = 0
        pages = {}
        admits = [Admit(0, 29, 0.0, 1.0, 0, 0)]
        for end in splits:
            triples = [(0, b, 1 + b) for b in range(start // PAGE, (end - 1) // PAGE + 1) if b not in pages]
            pages.update({b: 1 + b for _, b, _ in triples})
            pos = len(short) - 1  # row 1's input position this step
            if pos % PAGE == 0:
                triples.append((1, pos // PAGE, 10 + pos // PAGE))
            cmd = Command(step, admits=admits, chunks=[Chunk(0, start, end - start, 0, end == 29)],
                          new_pages=np.array(triples, np.int32).reshape(-1, 3))
            rt.execute(cmd, np.array(long_prompt[start:end], np.int32), out)
            with torch.no_grad():
                want_short = model(torch.tensor([short])).logits[0, -1]
            torch.testing.assert_close(rt.logits[1], want_short, atol=1e-4, rtol=1e-4)
            short.append(int(out[1]))
            admits, start, step = [], end, step + 1
        with torch.no_grad():
            want_long = model(torch.tensor([long_prompt])).logits[0, -1]
        torch.testing.assert_close(rt.logits[0], want_long, atol=1e-4, rtol=1e-4)
        assert int(out[0]) == int(want_long.argmax())
        rt.finish_rows([0, 1])


@pytest.mark.parametrize("budget", [9, 16, 37])
def test_chunked_prefill_greedy_tokens_equal_transformers(ckpt, reference, budget: int) -> None:
    ps = prompts(2, [40, 3, 70, 17, 25])
    with worker(ckpt, max_num_batched_tokens=budget) as w:
        outs = w.generate(ps, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
        assert w.stats()["kv_pages_free"] == w.stats()["kv_pages_total"]
    assert [o.token_ids for o in outs] == [reference(p, 10) for p in ps]


def test_decoding_rows_produce_tokens_while_a_long_prompt_prefills(ckpt) -> None:
    with worker(ckpt, max_num_batched_tokens=16) as w:
        engine = w.engine
        rows = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True), stream=True)
                for p in prompts(3, [4, 5, 6])]
        while min(len(s.seqs[0].tokens) for s in rows) < 2:
            engine.step()
        long = engine.add_request(prompts(4, [200])[0], SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        before = [len(s.seqs[0].tokens) for s in rows]
        steps = 0
        while not long.finished:
            engine.step()
            steps += 1
        during = [len(s.seqs[0].tokens) - b for s, b in zip(rows, before)]
        assert steps >= 200 // 16
        assert min(during) >= steps - 3  # every decoding row advanced on (nearly) every step
        for s in rows:
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()


# -- prefix caching ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE + 3])
def test_prefix_hits_at_every_page_boundary_give_the_same_tokens(ckpt, reference, shared: int) -> None:
    head = prompts(5, [shared])[0]
    tails = prompts(6, [1, 6, 11])
    with worker(ckpt) as w:
        first = w.generate([head + tails[0]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
        later = w.generate([head + t for t in tails[1:]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        cached = (shared // PAGE) * PAGE
        assert [o.num_cached_tokens for o in later] == [cached, cached]
        stats = w.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert first.token_ids == reference(head + tails[0], 6)
    assert [o.token_ids for o in later] == [reference(head + t, 6) for t in tails[1:]]


def test_multi_turn_chat_reuses_the_previous_turn(ckpt) -> None:
    turn = prompts(7, [21])[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with worker(ckpt) as on, worker(ckpt, enable_prefix_caching=False) as off:
        history_on, history_off = list(turn), list(turn)
        for k in range(3):
            a = on.generate([history_on], params)[0]
            b = off.generate([history_off], params)[0]
            assert a.token_ids == b.token_ids
            assert b.num_cached_tokens == 0
            if k:  # the earlier turns, prompt and answer, are cached
                assert a.num_cached_tokens >= (len(history_on) - 12 - 3 - PAGE)
            history_on += a.token_ids + [7, 8, 9]
            history_off += b.token_ids + [7, 8, 9]
        hits = on.engine.metrics.value("l3worker:prefix_cache_hits_total")
        assert hits > 0 and off.engine.metrics.value("l3worker:prefix_cache_hits_total") == 0


def test_eviction_pressure_keeps_outputs_identical(ckpt) -> None:
    """A pool of 24 pages serving 30 prompts that share a prefix: cached pages are evicted and
    reused all the time, and every output equals an uncached run's."""
    head = prompts(8, [2 * PAGE])[0]
    ps = [head + t for t in prompts(9, list(range(5, 35)))]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with worker(ckpt, num_pages=24, max_batch_size=2) as w, worker(ckpt, enable_prefix_caching=False) as ref:
        got = [w.generate([p], params)[0].token_ids for p in ps]
        want = [o.token_ids for o in ref.generate(ps, params)]
        pool = w.engine.scheduler.pages
        assert pool.evicted_pages > 0 and pool.hits_tokens > 0
        assert pool.num_free == 24
    assert got == want


def test_a_forged_hash_collision_is_not_a_hit(ckpt, monkeypatch) -> None:
    monkeypatch.setattr(page_pool, "hash_page", lambda parent, ids: 12345)  # every page collides
    a, b = prompts(10, [3 * PAGE, 3 * PAGE])
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    with worker(ckpt) as w, worker(ckpt, enable_prefix_caching=False) as ref:
        w.generate([a], params)
        got = w.generate([b], params)[0]
        assert got.num_cached_tokens == 0  # same hash, other ids: no hit
        again = w.generate([a], params)[0]
        assert got.token_ids == ref.generate([b], params)[0].token_ids
        assert again.token_ids == ref.generate([a], params)[0].token_ids


# -- pages on demand and preemption ------------------------------------------------------------------

def test_half_the_worst_case_pool_runs_every_row_and_preempts_with_identical_outputs(ckpt) -> None:
    rows, plen, new = 4, 16, 48
    worst = -(-(plen + new - 1) // PAGE)  # 8 pages per row at its longest
    ps = prompts(11, [plen] * rows)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.9, seed=5)
    with worker(ckpt) as big:
        want = [o.token_ids for o in big.generate(ps + ps, [greedy] * rows + [seeded] * rows)]
    with worker(ckpt, num_pages=rows * worst // 2) as small:
        engine = small.engine
        states = [engine.add_request(p, q) for p, q in zip(ps + ps, [greedy] * rows + [seeded] * rows)]
        most, finals = 0, {}
        while len(finals) < len(states):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
            most = max(most, len(engine.scheduler.running))
        assert most == rows  # reserving the worst case, only half of them would have run at once
        assert engine.scheduler.num_preemptions > 0
        assert engine.metrics.value("l3worker:num_preemptions_total") == engine.scheduler.num_preemptions
        assert small.stats()["kv_pages_free"] == rows * worst // 2
    assert [finals[s.request_id] for s in states] == want


def test_a_request_that_can_never_fit_is_refused_up_front(ckpt) -> None:
    with worker(ckpt, num_pages=4) as w:
        with pytest.raises(ValueError, match="num_pages=4"):
            w.generate([prompts(12, [30])[0]], SamplingParams(temperature=0.0, max_new_tokens=8))
        assert len(w.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4)).pop().token_ids) == 4
