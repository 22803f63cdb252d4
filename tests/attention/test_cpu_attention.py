"""The cpu attention backend: decode steps on a kernel that reads the paged cache in place
(chip_child.cpu_kernels.decode_attention, on AVX-512 or on AVX2). Each kernel agrees with a
float32 softmax attention over shuffled pages, the backend gives transformers' greedy tokens and
logits in float32 on each, and where the kernels are turned off the backend's decode steps take
the torch paths, still correct."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chip_child.attention import backend_choices, default_backend_name, get_backend
from chip_child.attention.cpu_backend import CpuAttention
from chip_child.config import RuntimeConfig
from chip_child.cpu_kernels import decode_attention
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step.runtime import ChipRuntime

from kernel_helpers import decide_again, rule_out  # noqa: E402
from parity import assert_matches_transformers  # noqa: E402

needs_kernel = pytest.mark.skipif(decode_attention.library() is None,
                                  reason="neither decode attention kernel runs here")
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
KERNELS = {"avx512": decode_attention.KERNEL, "avx2": decode_attention.AVX2_KERNEL}


@pytest.fixture(params=list(KERNELS))
def lib(request, monkeypatch):
    """Each kernel where it runs here, as the one the backend takes (the AVX-512 one ruled out for
    the AVX2 one, so that it runs on cpus with AVX-512 too)."""
    kernel = KERNELS[request.param]
    if not kernel.usable():
        pytest.skip(f"{kernel.name} unusable here: {kernel.why_not()}")
    if request.param == "avx2":
        rule_out(monkeypatch, decode_attention.KERNEL)
    assert decode_attention.library() is kernel.library()
    return kernel.library()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# groups of 1 to 32 query heads: passes of up to four heads (two on AVX2), and what is left (6 = 4 + 2);
# head sizes in whole and partial vectors of 16 (8 on AVX2), values in slices of 4 vectors on AVX2 (24, 48)
@pytest.mark.parametrize("kv_heads,group,head_dim", [(1, 1, 16), (2, 2, 32), (2, 3, 24), (2, 3, 64), (1, 6, 64),
                                                    (4, 8, 128), (1, 16, 256), (1, 32, 48), (1, 3, 20)])
def test_kernel_matches_a_float32_softmax_attention(lib, dtype, kv_heads: int, group: int, head_dim: int) -> None:
    """Context lengths 1, a page's end, a page's end plus one, many pages; pages shuffled."""
    g = torch.Generator().manual_seed(kv_heads * 100 + group)
    page, pages = 8, 48
    lens = torch.tensor([1, 8, 9, 95], dtype=torch.int32)  # 12 pages of 8 a row
    table = torch.randperm(pages, generator=g).to(torch.int32).view(4, 12)
    k, v = (torch.randn(kv_heads, pages, page, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(4, kv_heads * group, head_dim, generator=g).to(dtype)
    got = decode_attention.attend(lib, q, k, v, table, lens, head_dim ** -0.5, torch.empty_like(q)).float()
    want = decode_attention.reference(q, k, v, table, lens, head_dim ** -0.5)
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOLERANCE[dtype]


def test_cpu_is_the_default_on_the_cpu_and_torch_stays_a_choice() -> None:
    assert default_backend_name("cpu") == "cpu" and get_backend("cpu") is CpuAttention
    assert backend_choices("cpu")[:2] == ("torch", "cpu")
    with pytest.raises(ValueError, match=r"attention_backend='cpu' cannot run on cuda"):
        get_backend("cuda", "cpu")


def runtime(path, dtype: str = "float32", **overrides) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype=dtype, max_batch_size=4, max_seq_len=96,
                                     page_size=4, **overrides))


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).tolist() for n in (1, 6, 17, 40)]


def test_the_backend_gives_the_tokens_and_logits_of_transformers(lib, make_checkpoint, hf_model) -> None:
    path = make_checkpoint("cpu-attn", num_attention_heads=6, num_key_value_heads=2)
    model = hf_model(path)
    ps = prompts(model.config.vocab_size)
    rt = runtime(path)
    try:
        assert rt.attn.name == "cpu" and rt.attn.uses_kernel and not rt.attn.decode_mirror
        (check,) = [v for v in rt.kernel_checks if v.kernel == "attention"]
        assert check.used and check.error <= 1e-4  # its start-up check against the torch backend
        result = LocalDriver(rt).run([LocalRequest(p, 20) for p in ps], keep_logits=True)
    finally:
        rt.close()
    assert_matches_transformers(model, ps, result.token_ids, result.logits, 20)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_turned_off_the_decode_steps_take_the_torch_paths(make_checkpoint, monkeypatch, capsys, dtype: str) -> None:
    """float32: the same greedy tokens, logits within float32 rounding. bf16 (where a tiny random
    model's near-ties can part the tokens): the first decode step's logits, made from the same
    inputs, within bf16 rounding."""
    path = make_checkpoint("cpu-attn", num_attention_heads=6, num_key_value_heads=2)
    ps = prompts(300)
    results = {}
    for forced in (True, False):
        monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_decode_attention" if forced else "")
        decide_again(monkeypatch, decode_attention.KERNEL)  # both under this environment
        decide_again(monkeypatch, decode_attention.AVX2_KERNEL)
        rt = runtime(path, dtype=dtype)
        try:
            assert rt.attn.name == "cpu" and rt.attn.uses_kernel is not forced
            results[forced] = LocalDriver(rt).run([LocalRequest(p, 16) for p in ps], keep_logits=True)
        finally:
            rt.close()
    assert "not the cpu_decode_attention kernel: forced by L3WORKER_REFERENCE_KERNELS" in capsys.readouterr().err
    if dtype == "float32":
        assert results[False].token_ids == results[True].token_ids
    tol = 1e-5 if dtype == "float32" else 5e-2
    for mine, theirs in zip(results[False].logits, results[True].logits):
        steps = range(len(mine)) if dtype == "float32" else [1]
        for i in steps:
            assert ((mine[i] - theirs[i]).abs().max() / theirs[i].abs().max()).item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,page", [(6, 2, 64, 4), (4, 4, 24, 16), (8, 1, 128, 8)])
def test_mixed_and_pure_decode_steps_match_the_torch_backend(lib, dtype, heads: int, kv_heads: int, head_dim: int,
                                                             page: int) -> None:
    """The start-up check's steps (chip_child.attention.self_check): prompt chunks, a decode row
    beside a chunk (the kernel for the row, SDPA for the chunk), then a pure decode step."""
    from chip_child.attention.base import AttentionSpec
    from chip_child.attention.self_check import attention_error

    spec = AttentionSpec(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_pages=16,
                         page_size=page, dtype=dtype, max_tokens=32, max_seqs=4, max_blocks=8)
    assert attention_error(CpuAttention, spec, torch.device("cpu")) <= TOLERANCE[dtype] * 5


def test_the_kernel_refuses_lengths_it_would_misread(lib) -> None:
    """It reads the tables through raw pointers: int64 ones are refused by name, not misread."""
    k = v = torch.zeros(1, 4, 4, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="block_table and seq_lens must be int32, got torch.int64 and torch.int32"):
        decode_attention.attend(lib, q, k, v, torch.zeros(1, 4, dtype=torch.int64),
                                torch.ones(1, dtype=torch.int32), 0.25, torch.empty_like(q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_writes_the_new_keys_and_values_as_a_cache_write_would(lib, dtype) -> None:
    """Handed the step's new keys and values (strided slices of a qkv row, as the model gives them),
    the kernel leaves the cache with the bits an index_copy_ by slot leaves, and the output that
    attending after that write gives."""
    g = torch.Generator().manual_seed(7)
    kv_heads, group, hd, page, pages = 2, 3, 64, 8, 48
    lens = torch.tensor([1, 8, 9, 95], dtype=torch.int32)
    table = torch.randperm(pages, generator=g).to(torch.int32).view(4, 12)
    cache = torch.randn(2, kv_heads, pages, page, hd, generator=g).to(dtype)
    qkv = torch.randn(4, kv_heads * (group + 2), hd, generator=g).to(dtype)
    q, k, v = qkv.split_with_sizes((kv_heads * group, kv_heads, kv_heads), 1)
    last = lens.long() - 1
    slots = (table[torch.arange(4), last // page].long() * page + last % page).to(torch.int32)
    written = cache.clone()
    for i, x in enumerate((k, v)):  # the torch backend's write: rows by slot, [pages * page, kv_heads, hd]
        rows = written[i].permute(1, 2, 0, 3).reshape(pages * page, kv_heads, hd).index_copy(0, slots.long(), x)
        written[i] = rows.view(pages, page, kv_heads, hd).permute(2, 0, 1, 3)
    want = decode_attention.attend(lib, q, written[0], written[1], table, lens, hd ** -0.5, torch.empty_like(q))
    got = decode_attention.attend(lib, q, cache[0], cache[1], table, lens, hd ** -0.5, torch.empty_like(q),
                                  new_kv=(k, v, slots))
    assert torch.equal(cache, written)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"new_kv: k and v must be \[4, 2, 64\] and slots \[4\]"):
        decode_attention.attend(lib, q, cache[0], cache[1], table, lens, hd ** -0.5, torch.empty_like(q),
                                new_kv=(k[:3], v[:3], slots[:3]))
