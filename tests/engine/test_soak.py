"""Long use of one worker: 500 sequential requests of varied shapes, batch neighbours and sampling
modes give the tokens of a fresh run, return every KV page, and keep resident memory flat."""
from __future__ import annotations

import gc
import os

import numpy as np
import psutil

from l3worker import DistributedWorker, SamplingParams

# 3 rows and 14 pages of 8 tokens: batches of up to 4 prompts queue for rows and for pages.
CONFIG = {"device": "cpu", "max_batch_size": 3, "max_seq_len": 64, "page_size": 8, "num_pages": 14,
          "num_threads": 1}
DISTINCT = 50
TOTAL = 500
WARM_UP = 50  # requests served before the first memory reading
MAX_RSS_GROWTH = 20 * 2**20


def _requests(rng: np.random.Generator) -> list[tuple[list[int], SamplingParams]]:
    """DISTINCT requests: prompts of 1..30 tokens (spanning page boundaries), 1..24 new tokens,
    greedy and seeded sampling, with and without eos and stop tokens."""
    reqs = []
    for i in range(DISTINCT):
        prompt = rng.integers(0, 320, size=int(rng.integers(1, 31))).tolist()
        kind = i % 4
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, 25)),
            temperature=0.0 if kind < 2 else 0.8,
            top_p=0.9 if kind == 3 else 1.0,
            top_k=20 if kind == 2 else 0,
            seed=None if kind < 2 else 1000 + i,
            stop_token_ids=(int(rng.integers(0, 320)),) if i % 5 == 0 else (),
            ignore_eos=i % 3 == 0,
        )
        reqs.append((prompt, params))
    return reqs


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_soak_500_requests() -> None:
    rng = np.random.default_rng(0)
    reqs = _requests(rng)
    with DistributedWorker(**CONFIG) as fresh:
        reference = [fresh.generate([p], s)[0].token_ids for p, s in reqs]
    assert len({tuple(t) for t in reference}) > DISTINCT // 2, "references too alike to tell requests apart"

    with DistributedWorker(**CONFIG) as w:
        child = w.child_pids[0]
        total_pages = w.stats()["kv_pages_total"]
        served, batch_sizes, rss_warm = 0, set(), None
        while served < TOTAL:
            size = min(int(rng.integers(1, 5)), TOTAL - served)
            picks = rng.integers(0, DISTINCT, size=size).tolist()
            outs = w.generate([reqs[i][0] for i in picks], [reqs[i][1] for i in picks])
            for i, out in zip(picks, outs):
                assert out.token_ids == reference[i], f"request {i} in a batch of {picks} after {served} requests"
            st = w.stats()
            assert st["kv_pages_free"] == st["kv_pages_total"] == total_pages, f"pages leaked after {served}"
            served += size
            batch_sizes.add(size)
            if rss_warm is None and served >= WARM_UP:
                gc.collect()
                rss_warm = (_rss(os.getpid()), _rss(child))
        gc.collect()
        rss_end = (_rss(os.getpid()), _rss(child))
        assert w.stats()["requests_served"] == TOTAL
    assert batch_sizes == {1, 2, 3, 4}

    mib = 2**20
    print(f"\n[soak] {TOTAL} requests; rss after {WARM_UP}: parent {rss_warm[0] / mib:.1f} MiB, "
          f"child {rss_warm[1] / mib:.1f} MiB; at the end: parent {rss_end[0] / mib:.1f} MiB, "
          f"child {rss_end[1] / mib:.1f} MiB")
    for who, before, after in zip(("parent", "child"), rss_warm, rss_end):
        assert after - before < MAX_RSS_GROWTH, f"{who} rss grew {(after - before) / mib:.1f} MiB"
