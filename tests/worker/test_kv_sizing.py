"""gpu_memory_utilization: KV pages from a share of the device's memory less the weights, computed in
the parent before any child starts (l3worker/worker/kv_sizing.py), and the worker built with them;
kv_cache_memory_bytes and vLLM's VLLM_CPU_KVCACHE_SPACE: pages from the cache's own bytes."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

from chip_child.models.loader import load_config
from chip_child.models.qwen3 import shard_config
from chip_child.models.tiny_model import ensure_tiny_model
from l3worker import DistributedWorker, SamplingParams
from l3worker.worker import kv_sizing
from l3worker.worker.kv_sizing import (CPU_KVCACHE_SPACE_ENV, accelerator_memory_bytes, cgroup_memory_limit,
                                       kv_bytes_per_token, kv_cache_bytes, size_kv_cache, size_kv_cache_in,
                                       weight_bytes)

GIB = 1 << 30
FP32 = 4


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


def stored_elements(model_dir: Path) -> int:
    """Every tensor's element count, read from the checkpoint itself."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def test_pages_are_the_fraction_less_the_weights_over_one_pages_kv_bytes(tiny) -> None:
    cfg = load_config(tiny)
    weights = stored_elements(tiny) * FP32
    assert weight_bytes(cfg, FP32) == weights
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * FP32
    assert kv_bytes_per_token(cfg, FP32) == per_token
    s = size_kv_cache(cfg, fraction=0.5, kind="cpu", device_id=0, itemsize=FP32, local_ranks=1, page_size=16,
                      max_seq_len=64, memory=(GIB, GIB))
    assert s.num_pages == (GIB // 2 - weights) // (per_token * 16) - 1  # page 0 is the scratch page
    assert (s.tokens, s.weight_bytes, s.memory_bytes) == (s.num_pages * 16, weights, GIB)


def test_ranks_on_one_cpu_share_its_memory(tiny) -> None:
    cfg = load_config(tiny)
    half = shard_config(cfg, 2)
    one = size_kv_cache(cfg, fraction=0.5, kind="cpu", device_id=0, itemsize=FP32, local_ranks=1, page_size=16,
                        max_seq_len=64, memory=(GIB, GIB))
    two = size_kv_cache(half, fraction=0.5, kind="cpu", device_id=0, itemsize=FP32, local_ranks=2, page_size=16,
                        max_seq_len=64, memory=(GIB, GIB))
    assert two.page_bytes == one.page_bytes  # each rank holds half the heads of every page
    assert two.weight_bytes >= one.weight_bytes  # and its own copy of what is not split (embeddings, norms)
    # an accelerator's memory is its own: the fraction of one device against one rank's share
    gpu = size_kv_cache(half, fraction=0.5, kind="cuda", device_id=0, itemsize=FP32, local_ranks=2, page_size=16,
                        max_seq_len=64, memory=(GIB, GIB))
    assert gpu.page_bytes == one.page_bytes // 2 and gpu.weight_bytes == weight_bytes(half, FP32)


@pytest.mark.parametrize("fraction,memory,needle", [
    (0.0, (GIB, GIB), "gpu_memory_utilization must be in (0, 1], got 0.0"),
    (1.5, (GIB, GIB), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (1e-6, (GIB, GIB), "one row of max_seq_len=512 needs 32 pages of 16 tokens"),
])
def test_refusals_name_the_field_and_the_limit(tiny, fraction, memory, needle) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization") as e:
        size_kv_cache(load_config(tiny), fraction=fraction, kind="cpu", device_id=0, itemsize=FP32, local_ranks=1,
                      page_size=16, max_seq_len=512, memory=memory)
    assert needle in str(e.value)
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        size_kv_cache(load_config(tiny), fraction=True, kind="cpu", device_id=0, itemsize=FP32, local_ranks=1,
                      page_size=16, max_seq_len=512, memory=memory)


def test_an_accelerator_with_less_free_than_asked_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9: cuda:1 has 10.00 GiB free of 80.00 GiB, "
                                         r"less than the 72.00 GiB asked for"):
        size_kv_cache(load_config(tiny), fraction=0.9, kind="cuda", device_id=1, itemsize=2, local_ranks=1,
                      page_size=16, max_seq_len=64, memory=(80 * GIB, 10 * GIB))


def test_a_device_whose_memory_cannot_be_read_is_named() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a cuda device")
    with pytest.raises(ValueError, match="gpu_memory_utilization: cannot read the memory of cuda device 0"):
        accelerator_memory_bytes("cuda", 0)


def test_the_cgroup_limit_is_read_from_v1_and_v2(tmp_path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "app").mkdir(parents=True)
    (v2 / "app" / "memory.max").write_text("2147483648\n")
    (v2 / "memory.max").write_text("max\n")
    (tmp_path / "cg2").write_text("0::/app\n")
    assert cgroup_memory_limit(str(tmp_path / "cg2"), str(v2)) == 2 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(str(3 * GIB))
    (tmp_path / "cg1").write_text("5:cpu,cpuacct:/job\n4:memory:/job\n")
    assert cgroup_memory_limit(str(tmp_path / "cg1"), str(v1)) == 3 * GIB
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert cgroup_memory_limit(str(tmp_path / "cg1"), str(v1)) is None
    assert cgroup_memory_limit(str(tmp_path / "absent"), str(v1)) is None


def test_the_worker_sizes_its_cache_from_the_fraction_and_serves_with_it(tiny, monkeypatch) -> None:
    cfg = load_config(tiny)
    page_bytes = kv_bytes_per_token(cfg, FP32) * 8
    memory = 4 * (weight_bytes(cfg, FP32) + 41 * page_bytes)  # a quarter of it: the weights and 41 pages
    monkeypatch.setattr(kv_sizing, "cpu_memory_bytes", lambda: memory)
    common = dict(device="cpu", max_batch_size=2, max_seq_len=64, page_size=8, num_threads=1)
    with DistributedWorker(str(tiny), gpu_memory_utilization=0.25, **common) as w:
        assert w.kv_sizing.num_pages == 40 and w.runtime_config.total_pages == 41
        out = w.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and w.stats()["kv_pages_total"] == 40
    # num_pages, when given, wins (vLLM's --num-gpu-blocks-override); None keeps room for every row
    w = DistributedWorker(str(tiny), gpu_memory_utilization=0.25, num_pages=12, **common)
    assert w.runtime_config.total_pages == 13
    w.close()
    w = DistributedWorker(str(tiny), **common)
    assert w.kv_sizing is None and w.runtime_config.total_pages == 2 * 64 // 8 + 1
    w.close()
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.001 leaves .* one row of max_seq_len=64"):
        DistributedWorker(str(tiny), gpu_memory_utilization=0.001, **common)


# -- the cache's own bytes: kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE --------------------------------
def test_the_setting_wins_over_the_environment_which_counts_on_a_cpu_only() -> None:
    env = {CPU_KVCACHE_SPACE_ENV: "4"}
    assert kv_cache_bytes(None, "cpu", env) == (4 * GIB, "VLLM_CPU_KVCACHE_SPACE=4")
    assert kv_cache_bytes(None, "cuda", env) is None  # vLLM reads it on its cpu backend alone
    assert kv_cache_bytes(123456, "cpu", env) == (123456, "kv_cache_memory_bytes=123456")
    for unset in ({}, {CPU_KVCACHE_SPACE_ENV: ""}, {CPU_KVCACHE_SPACE_ENV: "0"}):  # vLLM's default is 0
        assert kv_cache_bytes(None, "cpu", unset) is None


@pytest.mark.parametrize("asked,env,needle", [
    (0, {}, "kv_cache_memory_bytes must be a positive number of bytes, got 0"),
    (-5, {}, "kv_cache_memory_bytes must be a positive number of bytes, got -5"),
    (1.5e9, {}, "kv_cache_memory_bytes must be a positive number of bytes, got 1500000000.0"),
    (True, {}, "kv_cache_memory_bytes must be a positive number of bytes, got True"),
    (None, {CPU_KVCACHE_SPACE_ENV: "4.5"}, "VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got '4.5'"),
    (None, {CPU_KVCACHE_SPACE_ENV: "-1"}, "VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got '-1'"),
])
def test_bad_cache_sizes_are_refused_by_name(asked, env, needle) -> None:
    with pytest.raises(ValueError) as e:
        kv_cache_bytes(asked, "cpu", env)
    assert needle in str(e.value)


def test_pages_are_the_caches_bytes_over_one_pages_kv_bytes_on_each_rank(tiny) -> None:
    cfg = load_config(tiny)
    page_bytes = kv_bytes_per_token(cfg, FP32) * 16
    s = size_kv_cache_in(cfg, (100 * page_bytes + 7, "kv_cache_memory_bytes=x"), kind="cpu", local_ranks=1,
                         kv_itemsize=FP32, page_size=16, max_seq_len=64, memory=GIB)
    assert (s.num_pages, s.page_bytes, s.fraction, s.source) == (99, page_bytes, None, "kv_cache_memory_bytes=x")
    assert s.describe() == f"99 KV pages (1584 tokens) in {(100 * page_bytes + 7) / (1 << 20):.1f} MiB " \
                           "(kv_cache_memory_bytes=x)"
    # two ranks: each holds half the heads of every page in bytes of its own, as vLLM's workers do
    half = size_kv_cache_in(shard_config(cfg, 2), (100 * page_bytes, "kv_cache_memory_bytes=x"), kind="cpu",
                            local_ranks=2, kv_itemsize=FP32, page_size=16, max_seq_len=64, memory=GIB)
    assert half.num_pages == 199


def test_a_cache_that_overflows_the_memory_or_misses_a_row_is_refused(tiny) -> None:
    cfg = load_config(tiny)
    with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=2: 2 cache\(s\) of 2.00 GiB exceed the 3.00 GiB "
                                         r"of memory this process may use; lower VLLM_CPU_KVCACHE_SPACE"):
        size_kv_cache_in(cfg, (2 * GIB, "VLLM_CPU_KVCACHE_SPACE=2"), kind="cpu", local_ranks=2, kv_itemsize=FP32,
                         page_size=16, max_seq_len=64, memory=3 * GIB)
    page_bytes = kv_bytes_per_token(cfg, FP32) * 16
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=\d+ leaves .*one row of max_seq_len=512 needs 32 "
                                         r"pages of 16 tokens: raise kv_cache_memory_bytes or lower max_seq_len"):
        size_kv_cache_in(cfg, kv_cache_bytes(10 * page_bytes, "cpu"), kind="cpu", local_ranks=1, kv_itemsize=FP32,
                         page_size=16, max_seq_len=512, memory=GIB)


def test_the_worker_sizes_its_cache_from_the_bytes_or_vllms_variable(tiny, monkeypatch) -> None:
    cfg = load_config(tiny)
    page_bytes = kv_bytes_per_token(cfg, FP32) * 8
    common = dict(device="cpu", max_batch_size=2, max_seq_len=64, page_size=8, num_threads=1)
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    # the bytes win over the fraction, as in vLLM
    with DistributedWorker(str(tiny), kv_cache_memory_bytes=31 * page_bytes, gpu_memory_utilization=0.9,
                           **common) as w:
        assert w.kv_sizing.num_pages == 30 and w.runtime_config.total_pages == 31
        out = w.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and w.stats()["kv_pages_total"] == 30
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "1")
    w = DistributedWorker(str(tiny), **common)
    assert w.kv_sizing.source == "VLLM_CPU_KVCACHE_SPACE=1" and w.kv_sizing.num_pages == GIB // page_bytes - 1
    w.close()
    w = DistributedWorker(str(tiny), num_pages=12, **common)  # --num-gpu-blocks-override wins over both
    assert w.runtime_config.total_pages == 13
    w.close()
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got 'lots'"):
        DistributedWorker(str(tiny), **common)
