"""The engine loop: requests joining and leaving a running batch from threads and coroutines,
streaming deltas, stop strings, n samples, metrics, and failure while streams are open."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading

import pytest

from l3worker import AsyncEngine, DistributedWorker, EngineDeadError, SamplingParams
from l3worker.engine.detokenizer import SampleText

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)


def make_worker(**kw) -> DistributedWorker:
    kw = dict(max_batch_size=4, max_seq_len=256, page_size=16) | kw
    return DistributedWorker(**kw)


@pytest.fixture(scope="module")
def worker():
    with make_worker() as w:
        yield w


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def solo(worker):
    """Each prompt's tokens when it runs alone in the batch."""
    cache: dict[tuple, list[int]] = {}

    def get(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = worker.generate([prompt], params)[0].token_ids
        return cache[key]

    return get


def drive(engine, until) -> list:
    outs = []
    while not until():
        outs += engine.step()
    return outs


def test_request_added_while_others_decode_matches_solo(worker, solo) -> None:
    engine = worker.engine
    ps = prompts(3)
    first = [engine.add_request(p, params) for p, params in zip(ps[:2], (GREEDY, SEEDED))]
    outs = []
    for _ in range(5):  # the first two are decoding now
        outs += engine.step()
    assert all(s.seqs[0].tokens for s in first)
    late = [engine.add_request(ps[2], GREEDY), engine.add_request(ps[2], SEEDED)]
    states = first + late
    outs += drive(engine, lambda: all(s.finished for s in states))
    finals = {o.request_id: o for o in outs if o.finished}
    expected = [solo(ps[0], GREEDY), solo(ps[1], SEEDED), solo(ps[2], GREEDY), solo(ps[2], SEEDED)]
    assert [finals[s.request_id].token_ids for s in states] == expected


def test_fifty_requests_from_threads_and_coroutines_match_solo_runs(solo) -> None:
    ps = prompts(50)
    params = [GREEDY if i % 2 else SEEDED for i in range(50)]
    expected = None
    with make_worker() as ref:
        expected = [ref.generate([p], q)[0].token_ids for p, q in zip(ps, params)]
    worker = make_worker()

    async def main() -> dict[int, list[int]]:
        engine = AsyncEngine(worker)
        await engine.start()
        loop = asyncio.get_running_loop()
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            await asyncio.sleep(random.Random(i).random() * 0.2)
            tokens = []
            async for out in engine.generate(ps[i], params[i]):
                for c in out.outputs:
                    tokens += c.delta_token_ids
                if out.finished:
                    assert out.token_ids == tokens
            got[i] = tokens

        def from_thread(indices: list[int]) -> None:  # another thread submitting into the loop
            futures = [asyncio.run_coroutine_threadsafe(one(i), loop) for i in indices]
            for f in futures:
                f.result(timeout=120)

        threads = [threading.Thread(target=from_thread, args=(list(range(k, 25, 3)),)) for k in range(3)]
        for t in threads:
            t.start()
        await asyncio.gather(*(one(i) for i in range(25, 50)))
        await asyncio.gather(*(loop.run_in_executor(None, t.join) for t in threads))
        assert engine.registry.get_sample_value("l3worker:num_requests_running") == 0
        # a served engine: prompt chunks beside decoding rows were bounded by time (step_timing)
        assert worker.engine.scheduler.prefill_cap == worker.engine.step_timing.prefill_cap() is not None
        await engine.shutdown()
        return got

    got = asyncio.run(main())
    assert [got[i] for i in range(50)] == expected
    assert worker.stats()["state"] == "closed"


def test_abort_frees_row_and_pages_and_leaves_others_unchanged(worker, solo) -> None:
    engine = worker.engine
    ps = prompts(3)
    total = worker.stats()["kv_pages_total"]
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    keep = [engine.add_request(ps[0], GREEDY), engine.add_request(ps[1], SEEDED)]
    victim = engine.add_request(ps[2], long)
    outs = []
    for _ in range(4):
        outs += engine.step()
    assert victim.seqs[0].tokens and not victim.finished
    engine.abort(victim.request_id)
    engine.abort("no-such-request")  # unknown ids are ignored
    outs += drive(engine, lambda: victim.finished)
    assert victim.seqs[0].row == -1 or engine.scheduler.running.get(victim.seqs[0].row) is not victim.seqs[0]
    outs += drive(engine, lambda: not engine.has_unfinished())
    finals = {o.request_id: o for o in outs if o.finished}
    assert finals[victim.request_id].finish_reason == "abort"
    assert len(finals[victim.request_id].token_ids) < 200
    assert [finals[s.request_id].token_ids for s in keep] == [solo(ps[0], GREEDY), solo(ps[1], SEEDED)]
    assert worker.stats()["kv_pages_free"] == total
    engine.abort(victim.request_id)  # aborting a finished request is a no-op
    assert engine.step() == []


def test_abort_of_a_waiting_request(worker) -> None:
    engine = worker.engine
    ps = prompts(6)
    states = [engine.add_request(p, GREEDY) for p in ps]  # 6 requests, 4 rows: two wait
    engine.step()
    waiting = states[-1]
    assert waiting.seqs[0].row == -1
    engine.abort(waiting.request_id)
    outs = drive(engine, lambda: not engine.has_unfinished())
    final = [o for o in outs if o.request_id == waiting.request_id]
    assert len(final) == 1 and final[0].finish_reason == "abort" and final[0].token_ids == []
    assert worker.stats()["kv_pages_free"] == worker.stats()["kv_pages_total"]


def _text_with_ascii_pair(worker) -> tuple[list[int], str, str]:
    """A prompt whose greedy text contains two printable ASCII characters in a row (two tokens)."""
    for p in prompts(40):
        text = worker.generate([p], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))[0].text
        for k in range(3, len(text) - 1):
            pair = text[k:k + 2]
            if pair.isascii() and pair.isprintable() and text.find(pair) == k:
                return p, text, pair
    pytest.fail("no greedy output with two ASCII characters in a row")


def test_stop_string_across_tokens_in_deltas_and_final_text(worker) -> None:
    prompt, text, stop = _text_with_ascii_pair(worker)
    at = text.find(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=[stop, "\x00never"],
                                include_stop_str_in_output=include)
        final = worker.generate([prompt], params)[0]
        want = text[:at + len(stop)] if include else text[:at]
        assert (final.text, final.finish_reason, final.stop_reason) == (want, "stop", stop)
        deltas, last = [], None
        for out in worker.stream([prompt], params):
            deltas += [c.delta_text for c in out.outputs]
            last = out
        assert "".join(deltas) == want  # no delta showed the stop string, or a prefix of it, early
        assert last.finished and last.text == want


def test_decode_stream_never_splits_a_character(worker) -> None:
    tok = worker.tokenizer
    words = "héllo wörld € 漢字 🙂 done"
    ids = list(words.encode())
    st = SampleText(tok, True, (), False)
    pieces = []
    for t in ids:
        st.add(t)
        pieces.append(st.delta(final=False))
    st.finish(ids, False)
    pieces.append(st.delta(final=True))
    assert "".join(pieces) == words
    assert all("\ufffd" not in p for p in pieces)  # a split character would decode as U+FFFD


def test_streamed_deltas_concatenate_to_final_output(worker) -> None:
    ps = prompts(5)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3, n=2)
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    for out in worker.stream(ps, params):
        for c in out.outputs:
            texts[out.request_id, c.index] = texts.get((out.request_id, c.index), "") + c.delta_text
            tokens[out.request_id, c.index] = tokens.get((out.request_id, c.index), []) + c.delta_token_ids
        if out.finished:
            finals[out.request_id] = out
    assert len(finals) == 5
    for rid, out in finals.items():
        for c in out.outputs:
            assert c.text == texts[rid, c.index] and c.token_ids == tokens[rid, c.index]
            assert c.text == worker.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_n_samples_are_reproducible_and_each_is_its_own_seed(worker) -> None:
    p = prompts(1)[0]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=100, n=3)
    a = worker.generate([p], params)[0]
    b = worker.generate([p], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    for i, c in enumerate(a.outputs):
        single = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=100 + i)
        assert worker.generate([p], single)[0].token_ids == c.token_ids


def test_bad_request_is_refused_and_running_requests_are_untouched(worker, solo) -> None:
    engine = worker.engine
    ps = prompts(2)
    running = engine.add_request(ps[0], GREEDY)
    engine.step()
    for bad, match in ((SamplingParams(temperature=0.0, top_p=0.0), "top_p"), (SamplingParams(temperature=0.0, presence_penalty=3.0), "presence_penalty"),
                       (SamplingParams(temperature=0.0, n=0), "n must"), (SamplingParams(temperature=0.0, logprobs=21), "logprobs"),
                       (SamplingParams(temperature=0.0, stop=[""]), "stop"), (SamplingParams(temperature=0.0, max_new_tokens=0), "max_tokens")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(ps[1], bad)
    with pytest.raises(ValueError, match="max_seq_len=256"):
        engine.add_request(ps[1], SamplingParams(temperature=0.0, max_new_tokens=250))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(ps[1], GREEDY, request_id=running.request_id)
    outs = drive(engine, lambda: running.finished)
    assert [o.token_ids for o in outs if o.finished] == [solo(ps[0], GREEDY)]


def test_metrics_count_tokens_requests_and_latencies(worker) -> None:
    m = worker.engine.metrics
    before = {name: m.value(name) for name in ("l3worker:generation_tokens_total", "l3worker:prompt_tokens_total",
                                               "l3worker:time_to_first_token_seconds_count",
                                               "l3worker:e2e_request_latency_seconds_count",
                                               "l3worker:inter_token_latency_seconds_count")}
    stops = m.value("l3worker:request_success_total", {"finished_reason": "length"})
    ps = prompts(6)
    outs = worker.generate(ps, GREEDY)
    generated = sum(len(o.token_ids) for o in outs)
    assert m.value("l3worker:generation_tokens_total") - before["l3worker:generation_tokens_total"] == generated
    assert m.value("l3worker:prompt_tokens_total") - before["l3worker:prompt_tokens_total"] == sum(map(len, ps))
    assert m.value("l3worker:time_to_first_token_seconds_count") - before[
        "l3worker:time_to_first_token_seconds_count"] == 6
    assert m.value("l3worker:e2e_request_latency_seconds_count") - before[
        "l3worker:e2e_request_latency_seconds_count"] == 6
    assert m.value("l3worker:inter_token_latency_seconds_count") - before[
        "l3worker:inter_token_latency_seconds_count"] == generated - 6
    assert m.value("l3worker:request_success_total", {"finished_reason": "length"}) - stops == 6
    assert m.value("l3worker:num_requests_running") == 0
    assert m.value("l3worker:num_requests_waiting") == 0
    assert m.value("l3worker:kv_cache_usage_perc") == 0


def test_progress_bar_reports_prompts_and_throughput(worker, capsys) -> None:
    worker.generate(prompts(3), GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output" in err and "tok/s" in err
    worker.generate(prompts(3), GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_killed_child_ends_every_open_stream_with_the_error() -> None:
    worker = make_worker(max_restarts=0)  # no restarts: the engine stops, as it did before they existed

    async def main() -> list[BaseException]:
        engine = AsyncEngine(worker)
        await engine.start()
        long = SamplingParams(temperature=0.0, max_new_tokens=220, ignore_eos=True)
        started = asyncio.Event()
        errors: list[BaseException] = []

        async def one(p: list[int]) -> None:
            try:
                async for _ in engine.generate(p, long):
                    started.set()
            except EngineDeadError as exc:
                errors.append(exc)

        tasks = [asyncio.create_task(one(p)) for p in prompts(3)]
        await started.wait()
        os.kill(worker.child_pids[0], signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        assert engine.dead
        with pytest.raises(EngineDeadError, match="chip-child 0"):
            async for _ in engine.generate([1, 2], GREEDY):
                pass
        await engine.shutdown()
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 3 and all("chip-child 0" in str(e) for e in errors)
    assert worker.child_pids == [] and worker.socket_dir is None
