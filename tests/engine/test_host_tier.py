"""The prefix cache's host tier (kv_offloading_size) through a worker: a device pool that holds 4
of 8 long prefixes finds all 8 in a second round, copied back from host memory, with the tokens a
run without the tier gives."""
from __future__ import annotations

import numpy as np
import pytest

from fault_helpers import guard
from l3worker import DistributedWorker, SamplingParams
from chip_child import protocol
from chip_child.config import Limits

KW = {"device": "cpu", "max_batch_size": 2, "max_seq_len": 128, "page_size": 16, "num_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_second_round_finds_every_prefix_in_the_host_tier(make_checkpoint) -> None:
    path = str(make_checkpoint())
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 290, 64).tolist() for _ in range(8)]  # 4 pages each, 3 of them cacheable
    with guard(), DistributedWorker(path, **KW) as w:
        want = [w.generate([p], GREEDY)[0].outputs[0].token_ids for p in prefixes]
    # 18 pages: room for the running request and about 4 prefixes' pages, not 8
    with guard(), DistributedWorker(path, num_pages=18, **KW) as w:
        [w.generate([p], GREEDY) for p in prefixes]
        without = [w.generate([p], GREEDY)[0].num_cached_tokens for p in prefixes]
    with guard(), DistributedWorker(path, num_pages=18, kv_offloading_size=0.01, **KW) as w:
        first = [w.generate([p], GREEDY)[0] for p in prefixes]
        second = [w.generate([p], GREEDY)[0] for p in prefixes]
        host = w.engine.scheduler.pages.host
        assert host.stored_pages > 0 and host.loaded_pages >= 8
    assert sum(without) < 8 * 48  # without the tier, the pool lost prefixes
    assert [o.num_cached_tokens for o in second] == [48] * 8  # with it, every one came back
    assert [o.outputs[0].token_ids for o in first + second] == want + want


def test_host_copies_are_checked_before_anything_is_applied() -> None:
    limits = Limits(2, 8, 10, 128, 64, 16, host_pages=4)
    copies = np.array([[0, 3, 1], [1, 2, 3]], np.int32)
    assert (protocol.decode(protocol.encode(protocol.Copies(copies)), limits).copies == copies).all()
    for bad, message in (([[2, 3, 1]], "kind must be"), ([[0, 3, 4]], "host slot outside"),
                         ([[0, 0, 1]], "page id outside")):
        with pytest.raises(protocol.ProtocolError, match=message):
            protocol.decode(protocol.encode(protocol.Copies(np.array(bad, np.int32))), limits)
    no_tier = Limits(2, 8, 10, 128, 64, 16)
    with pytest.raises(protocol.ProtocolError, match="no host tier"):
        protocol.decode(protocol.encode(protocol.Copies(copies)), no_tier)


def test_the_size_is_checked_by_name(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size=1e-09 GiB holds no page"):
        DistributedWorker(str(make_checkpoint()), kv_offloading_size=1e-9, **KW)
