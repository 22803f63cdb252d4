"""The decode step's team (chip_child/cpu_kernels/step_team.h): a step of a few rows runs its
projections, attention and lm_head on the calling thread and a helper instead of an OpenMP region
each. The bits are those of one thread; the caller never waits for a helper that took no unit;
`L3WORKER_REFERENCE_KERNELS=cpu_step_team` puts the stages back on OpenMP regions."""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from chip_child.cpu_kernels import bf16_linear, decode_layers
from chip_child.local import LocalDriver

from kernel_helpers import decide_again  # noqa: E402
from test_cpu_decode_layers import REQUESTS, assert_same, checkpoint, runtime  # noqa: E402

needs_team = pytest.mark.skipif(not (decode_layers.TEAM_KERNEL.usable() and bf16_linear.KERNEL.usable()),
                                reason="the step team runs only beside the AVX-512 projection kernel")


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
@pytest.mark.parametrize("rows, n, k", [(1, 64, 32), (1, 4096, 512), (2, 3 * 64 + 17, 97), (3, 1536, 1536)])
def test_a_projection_on_the_team_gives_the_bits_of_one_thread(rows, n, k) -> None:
    lib, team = bf16_linear.KERNEL.library(), decode_layers.TEAM_KERNEL.library()
    packed, p = projection(lib, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = on_one_thread(lib, packed, x, n)
    for threads in (2, 3, 2):  # a team per size, made on first use and kept
        assert torch.equal(on_team(team, p, x, n, threads), want)


@needs_team
def test_the_caller_runs_every_unit_when_no_helper_takes_one() -> None:
    """Helpers held off (as if another process had their cores): the call still completes, on the
    caller alone, where a barrier for every thread would wait for them."""
    lib, team = bf16_linear.KERNEL.library(), decode_layers.TEAM_KERNEL.library()
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
