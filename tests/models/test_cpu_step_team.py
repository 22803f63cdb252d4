"""The decode step's team (chip_child/cpu_kernels/step_team.h): a step of a few rows runs its
projections, attention and lm_head on the calling thread and a helper instead of an OpenMP region
each. The bits are those of one thread; the caller never waits for a helper that took no unit;
`L3WORKER_REFERENCE_KERNELS=cpu_step_team` puts the stages back on OpenMP regions."""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from chip_child.cpu_kernels import bf16_linear, decode_attention, decode_layers
from chip_child.local import LocalDriver

from kernel_helpers import decide_again  # noqa: E402
from test_cpu_decode_layers import REQUESTS, assert_same, checkpoint, runtime  # noqa: E402

needs_team = pytest.mark.skipif(not (decode_layers.TEAM_KERNEL.usable() and bf16_linear.best_kernel()),
                                reason="the step team runs only beside our bf16 projection kernels")
# Both kernels where the cpu runs both (an AVX-512 cpu runs the AVX2 one too): each has the team's entry.
LINEAR_KERNELS = [k for k in (bf16_linear.KERNEL, bf16_linear.AVX2_KERNEL) if k.usable()]


def projection(lib: ctypes.CDLL, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = bf16_linear.pack(lib, torch.randn(n, k, generator=g).to(torch.bfloat16))
    return packed, decode_layers.team_projection(lib, packed.data_ptr())


def on_one_thread(lib: ctypes.CDLL, packed: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    lib.l3_bf16_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None, y.data_ptr(), n, x.shape[0], n,
                       x.shape[1], 1)
    return y


def on_team(team: ctypes.CDLL, p, x: torch.Tensor, n: int, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    team.l3_team_linear(p, x.data_ptr(), x.stride(0), y.data_ptr(), n, x.shape[0], n, x.shape[1], threads)
    return y


@needs_team
@pytest.mark.parametrize("kernel", LINEAR_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows, n, k", [(1, 64, 32), (1, 4096, 512), (2, 3 * 64 + 17, 97), (3, 1536, 1536),
                                        (5, 2 * 64, 96)])  # AVX2: 5 rows take its many-rows path
def test_a_projection_on_the_team_gives_the_bits_of_one_thread(kernel, rows, n, k) -> None:
    lib, team = kernel.library(), decode_layers.TEAM_KERNEL.library()
    packed, p = projection(lib, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = on_one_thread(lib, packed, x, n)
    for threads in (2, 3, 2):  # a team per size, made on first use and kept
        assert torch.equal(on_team(team, p, x, n, threads), want)


@pytest.mark.parametrize("kernel", [k for k in (decode_attention.KERNEL, decode_attention.AVX2_KERNEL) if k.usable()],
                         ids=lambda k: k.name)
def test_attention_pairs_run_one_by_one_give_the_bits_of_the_whole_call(kernel) -> None:
    """The team's attention unit (`threads` -1 - pair: one (row, kv head) pair on the calling
    thread, its new key and value written first) over every pair: the whole call's output and cache."""
    g = torch.Generator().manual_seed(3)
    kvh, group, hd, page, pages, rows = 2, 3, 64, 4, 64, 4
    lens = torch.tensor([1, 7, 16, 61], dtype=torch.int32)
    table = torch.randperm(pages, generator=g).to(torch.int32).view(rows, 16)
    k, v = (torch.randn(kvh, pages, page, hd, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(rows, kvh * group, hd, generator=g).bfloat16()
    new_k, new_v = (torch.randn(rows, kvh, hd, generator=g).bfloat16() for _ in range(2))
    last = lens.long() - 1
    slots = (table[torch.arange(rows), last // page].long() * page + last % page).contiguous()
    new = (new_k, new_v, slots)
    lib = kernel.library()
    k_whole, v_whole, k_pairs, v_pairs = k.clone(), v.clone(), k.clone(), v.clone()
    whole = decode_attention.attend(lib, q, k_whole, v_whole, table, lens, 0.125, torch.empty_like(q), new, threads=2)
    one, k_one = torch.zeros_like(q), k.clone()  # pair 3 alone (row 1, kv head 1) touches its own part only
    decode_attention.attend(lib, q, k_one, v.clone(), table, lens, 0.125, one, new, threads=-1 - 3)
    assert torch.equal(one[1, group:], whole[1, group:]) and one.view(-1).count_nonzero() == group * hd
    assert torch.equal(k_one[1].reshape(-1, hd)[slots[1]], new_k[1, 1]) and (k_one != k).any(-1).sum() == 1
    pairs = torch.empty_like(q)
    for pair in range(rows * kvh):
        decode_attention.attend(lib, q, k_pairs, v_pairs, table, lens, 0.125, pairs, new, threads=-1 - pair)
    assert not torch.equal(k_whole, k)  # the new keys went in
    assert torch.equal(pairs, whole) and torch.equal(k_pairs, k_whole) and torch.equal(v_pairs, v_whole)


@needs_team
def test_the_caller_runs_every_unit_when_no_helper_takes_one() -> None:
    """Helpers held off (as if another process had their cores): the call still completes, on the
    caller alone, where a barrier for every thread would wait for them."""
    lib, team = bf16_linear.best_kernel()[1], decode_layers.TEAM_KERNEL.library()
    packed, p = projection(lib, 40 * 64, 256, seed=1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = on_one_thread(lib, packed, x, 40 * 64)
    on_team(team, p, x, 40 * 64, 2)  # the team of two exists
    team.l3_step_team_helper_units()  # counts from here
    team.l3_step_team_hold(1)
    try:
        result: list[torch.Tensor] = []
        caller = threading.Thread(target=lambda: result.append(on_team(team, p, x, 40 * 64, 2)), daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "the caller waited for a helper that took no unit"
        assert team.l3_step_team_helper_units() == 0
    finally:
        team.l3_step_team_hold(0)
    assert torch.equal(result[0], want)
    for _ in range(2000):  # released, the helper takes units again (once it is on a core as a stage runs)
        assert torch.equal(on_team(team, p, x, 40 * 64, 2), want)
        if team.l3_step_team_helper_units():
            break
    else:
        pytest.fail("no helper took a unit in 2,000 calls")


@needs_team
def test_decode_steps_and_their_lm_head_run_on_the_team_with_the_layer_by_layer_bits(tmp_path, monkeypatch) -> None:
    path = checkpoint(tmp_path / "ck", tie_word_embeddings=False)
    threads = torch.get_num_threads()  # a runtime sets the process's threads: put back after
    try:
        with monkeypatch.context() as m:  # the lm_head from Python, as a step with a sampled row runs it
            m.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_decode_head")
            decide_again(m, decode_layers.HEAD_KERNEL)
            rt = runtime(path, num_threads=2)
        try:
            fused = rt.decode_layers
            assert fused.team_rows >= 3 and fused._lm_head is not None  # REQUESTS decode 3 rows at most
            calls = []
            real = fused.lib.l3_team_linear
            monkeypatch.setattr(fused.lib, "l3_team_linear", lambda *a: calls.append(a[5]) or real(*a))
            mine = LocalDriver(rt).run(REQUESTS, keep_logits=True)
        finally:
            rt.close()
        assert len(calls) == 13 and set(calls) == {3}  # the lm_head of every decode step after the prefill
        with monkeypatch.context() as m:
            m.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_step_team")
            decide_again(m, decode_layers.TEAM_KERNEL)
            rt = runtime(path, num_threads=2)
            try:
                assert rt.decode_layers.team_rows == 0 and rt.decode_layers._lm_head is None
                theirs = LocalDriver(rt).run(REQUESTS, keep_logits=True)
            finally:
                rt.close()
    finally:
        torch.set_num_threads(threads)
    assert_same(mine, theirs)
