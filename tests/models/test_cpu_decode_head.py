"""A greedy bf16 decode step's end in one C call (l3_decode_head in chip_child.cpu_kernels.
decode_layers): the final norm, the lm_head on the step team, the fp32 logits and the argmax. It
gives the bits of final_logits and the sampler's first_max, checks that on its first step and is
refused when they differ, stays out of steps with a sampled row, and its load-time check catches a
pick that breaks argmax's ties or its NaN."""
from __future__ import annotations

import ctypes

import pytest

from chip_child.cpu_kernels import bf16_amx, bf16_linear, build, decode_layers
from chip_child.local import LocalDriver, LocalRequest

from kernel_helpers import decide_again  # noqa: E402
from test_cpu_decode_layers import REQUESTS, assert_same, checkpoint, runtime  # noqa: E402

# The head runs on the step team, which runs beside our bf16 projection kernels only.
needs_head = pytest.mark.skipif(not (decode_layers.HEAD_KERNEL.usable() and decode_layers.TEAM_KERNEL.usable()
                                     and bf16_linear.best_kernel()),
                                reason="the greedy head runs only beside our bf16 projection kernels")
# Rows that end apart: steps of 3, 2 and 1 rows in lanes of 4 and 2, each packed into the head's own buffers.
UNEVEN = [LocalRequest(list(range(3, 4)), 5), LocalRequest(list(range(3, 9)), 12), LocalRequest(list(range(3, 20)), 8)]


@pytest.fixture(autouse=True)
def no_amx(monkeypatch):
    """AMX, where the cpu has it, would take these small projections, and the team does not run it."""
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_bf16_amx")
    decide_again(monkeypatch, bf16_amx.KERNEL)


def run(path, requests=REQUESTS, calls: list | None = None):
    """The requests' tokens and logits, the runtime's decode_head verdicts and the head's calls."""
    lib = decode_layers.KERNEL.library()  # the one the decode layers call
    real = lib.l3_decode_head
    if calls is not None:
        lib.l3_decode_head = lambda *a: calls.append(a[2]) or real(*a)
    try:
        rt = runtime(path, num_threads=2)
        try:
            result = LocalDriver(rt).run(requests, keep_logits=True)
            return result, [v for v in rt.kernel_checks if v.kernel == "decode_head"], rt.decode_layers
        finally:
            rt.close()
    finally:
        if calls is not None:
            lib.l3_decode_head = real


def from_python(monkeypatch: pytest.MonkeyPatch, path, requests=REQUESTS):
    """The run with the head switched off (final_logits and the sampler), then on again."""
    with monkeypatch.context() as m:
        m.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_decode_head,cpu_bf16_amx")
        decide_again(m, decode_layers.HEAD_KERNEL)
        result, verdicts, _ = run(path, requests)
    assert verdicts == []
    return result


@needs_head
@pytest.mark.parametrize("requests, rows", [(REQUESTS, [3] * 13), (UNEVEN, [3] * 4 + [2] * 3 + [1] * 4)],
                         ids=["together", "apart"])
def test_greedy_steps_end_in_one_call_with_the_bits_of_final_logits_and_first_max(tmp_path, monkeypatch, requests,
                                                                                  rows) -> None:
    path = checkpoint(tmp_path / "ck")
    calls = []
    mine, verdicts, _ = run(path, requests, calls)
    assert [(v.used, v.error) for v in verdicts] == [(True, 0.0)]  # checked once, on its first step
    assert calls == rows  # every decode step after the prefill, with the rows still running
    assert_same(mine, from_python(monkeypatch, path, requests))


@needs_head
def test_a_first_step_that_differs_is_refused_and_its_ids_replaced(tmp_path, monkeypatch, capfd) -> None:
    path = checkpoint(tmp_path / "ck")
    lib = decode_layers.KERNEL.library()
    real = lib.l3_decode_head

    def wrong_pick(model, head, rows, h, delta, hidden, x, y, logits, ldl, ids, threads):
        real(model, head, rows, h, delta, hidden, x, y, logits, ldl, ids, threads)
        ctypes.c_int64.from_address(ids).value += 1  # the first row's id

    monkeypatch.setattr(lib, "l3_decode_head", wrong_pick)
    mine, verdicts, layers = run(path)
    assert [v.used for v in verdicts] == [False] and layers.head_refused
    assert "greedy steps take them from Python from now on" in capfd.readouterr().err
    monkeypatch.undo()
    assert_same(mine, from_python(monkeypatch, path))


@needs_head
def test_a_step_with_a_sampled_row_takes_the_sampler(tmp_path, monkeypatch) -> None:
    path = checkpoint(tmp_path / "ck")
    sampled = [LocalRequest(list(range(3, 9)), 10, temperature=0.8, seed=7), LocalRequest(list(range(4, 9)), 10)]
    calls = []
    mine, _, _ = run(path, sampled, calls)
    assert calls == []
    assert_same(mine, from_python(monkeypatch, path, sampled))


BROKEN_PICKS = {
    "the last of equal logits": "return a != a ? b == b : a >= b;",
    "a NaN passed over": "return a > b;",
}


@needs_head
@pytest.mark.parametrize("what", BROKEN_PICKS)
def test_the_load_time_check_catches_a_pick_unlike_argmax(tmp_path, monkeypatch, what) -> None:
    monkeypatch.setenv("L3WORKER_KERNEL_CACHE", str(tmp_path / "kernels"))
    source = (build.SOURCE_DIR / "decode_layers.cpp").read_text()
    right = "return a != a ? b == b : a > b;"
    assert source.count(right) == 1
    broken = tmp_path / "decode_layers.cpp"
    broken.write_text(source.replace(right, BROKEN_PICKS[what]))
    flags = decode_layers.HEAD_KERNEL.compile_flags
    assert decode_layers.check_head(decode_layers._bind(build.load(str(broken), flags))) == float("inf")
    assert decode_layers.check_head(decode_layers._bind(build.load("decode_layers.cpp", flags))) == 0.0
