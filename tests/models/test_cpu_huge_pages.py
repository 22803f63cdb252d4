"""Packed CPU weights on transparent huge pages (chip_child.cpu_kernels.huge_pages): each tensor
starts on a 2 MiB boundary in a mapping the kernel may back with huge pages, a small tail stays
on small pages, every tensor left on small pages is counted with why, and a worker's stats show
what its child asked for."""
from __future__ import annotations

import mmap

import pytest
import torch

from chip_child.cpu_kernels import bf16_linear, huge_pages
from chip_child.cpu_kernels.huge_pages import HUGE_PAGE, HugePageStats, huge_page_empty, thp_setting
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step.runtime import ChipRuntime, RuntimeConfig
from chip_child.step.sleep import weight_leaves
from l3worker import DistributedWorker

needs_huge_pages = pytest.mark.skipif(not huge_pages.STATS.system_allows, reason=f"transparent huge pages: {huge_pages.STATS.setting}")


@pytest.fixture
def stats(monkeypatch) -> HugePageStats:
    fresh = HugePageStats(setting=huge_pages.STATS.setting)
    monkeypatch.setattr(huge_pages, "STATS", fresh)
    return fresh


def thp_eligible(address: int) -> bool:
    """What /proc/self/smaps says of the mapping holding `address`: may huge pages back it?"""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_setting_reads_the_bracketed_word(tmp_path) -> None:
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert thp_setting(str(tmp_path / "enabled")) == "madvise"
    assert thp_setting(str(tmp_path / "missing")) == "unavailable"


@needs_huge_pages
def test_a_large_tensor_starts_on_a_huge_page_and_may_be_backed_by_them(stats) -> None:
    t = huge_page_empty(5 * HUGE_PAGE // 4 + 100, torch.bfloat16)  # 5 MiB + 200 bytes: 3 huge pages
    t.fill_(1.5)
    assert t.dtype == torch.bfloat16 and t.numel() == 5 * HUGE_PAGE // 4 + 100 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert stats.madvised_bytes == 3 * HUGE_PAGE and stats.small_page_tensors == 0
    assert thp_eligible(t.data_ptr()) and bool((t == 1.5).all())


@needs_huge_pages
def test_a_tail_under_half_a_huge_page_stays_on_small_pages(stats) -> None:
    huge_page_empty(HUGE_PAGE + HUGE_PAGE // 8, torch.uint8)  # 2.25 MiB: one huge page, the rest small
    assert stats.madvised_bytes == HUGE_PAGE
    small = huge_page_empty(HUGE_PAGE // 7, torch.float32)  # 1.14 MiB: rounds up to one huge page
    assert stats.madvised_bytes == 2 * HUGE_PAGE and small.data_ptr() % HUGE_PAGE == 0
    huge_page_empty(1000, torch.float32)  # 4 KB: small pages, counted
    assert stats.madvised_bytes == 2 * HUGE_PAGE and stats.small_page_tensors == 1


def test_huge_pages_off_leaves_small_pages_and_counts_them(stats) -> None:
    stats.setting = "never"
    t = huge_page_empty(HUGE_PAGE, torch.float32)
    assert t.numel() == HUGE_PAGE and stats.madvised_bytes == 0 and stats.small_page_tensors == 1


@needs_huge_pages
def test_a_refusal_is_counted_with_its_reason(stats, monkeypatch) -> None:
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 12345)  # advice the kernel does not know: EINVAL
    t = huge_page_empty(HUGE_PAGE, torch.uint8)
    t.fill_(3)
    assert stats.small_page_tensors == 1 and stats.madvised_bytes == 0 and "Invalid argument" in stats.refused
    assert int(t.sum()) == 3 * HUGE_PAGE


needs_kernel = pytest.mark.skipif(not bf16_linear.KERNEL.usable(), reason=f"kernel unusable here: {bf16_linear.KERNEL.why_not()}")
# gate/up of hidden 512 and intermediate 1024 pack to 2 MiB: at least one madvised matrix a layer
WIDE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)


@needs_huge_pages
@needs_kernel
def test_a_bf16_worker_reports_its_packed_weights_on_huge_pages(make_checkpoint) -> None:
    with DistributedWorker(str(make_checkpoint("huge_pages", **WIDE)), device="cpu", dtype="bfloat16",
                           max_batch_size=2, max_seq_len=64) as w:
        w.prepare()
        s = w.stats()
        assert s["cpu_linear"] in ("amx_bf16", "avx512_bf16")  # both read the packed copy
        assert s["cpu_huge_pages"]["setting"] == huge_pages.STATS.setting
        assert s["cpu_huge_pages"]["madvised_bytes"] >= 2 * HUGE_PAGE


@needs_huge_pages
@needs_kernel
def test_weights_on_huge_pages_give_the_bits_of_small_pages(make_checkpoint) -> None:
    """The same packed bytes moved onto ordinary memory: the same tokens and logits, bit for bit."""
    rt = ChipRuntime(RuntimeConfig(str(make_checkpoint("huge_pages", **WIDE)), device="cpu", dtype="bfloat16",
                                   max_batch_size=3, max_seq_len=64, page_size=16))
    try:
        requests = [LocalRequest(list(range(3, 3 + n)), 8) for n in (1, 6, 17)]
        packed = weight_leaves(rt.weights)[1]
        assert any(thp_eligible(p.weight.data_ptr()) for p in packed)
        on_huge = LocalDriver(rt).run(requests, keep_logits=True)
        for p in packed:
            p.weight = p.weight.clone()
        if rt.decode_layers is not None:  # moved behind the runtime's back, not by a control: say so
            rt.decode_layers.weights_moved()
        assert not any(thp_eligible(p.weight.data_ptr()) for p in packed if p.weight.nbytes >= HUGE_PAGE)
        on_small = LocalDriver(rt).run(requests, keep_logits=True)
    finally:
        rt.close()
    assert on_huge.token_ids == on_small.token_ids
    assert all(torch.equal(a, b) for x, y in zip(on_huge.logits, on_small.logits) for a, b in zip(x, y))
