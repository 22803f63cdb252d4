"""Attention backends against a dense reference and against each other.

The torch backend is checked against full per-sequence K/V with a causal softmax; the triton
backend (under Triton's interpreter on machines without a GPU) and the npu backend (through a
stand-in torch_npu that implements the vendor ops' documented semantics, tests/npu_reference.py)
are checked against the torch backend on the same steps.
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from chip_child.attention import AttentionMetadata, AttentionSpec, get_backend  # noqa: E402
from chip_child.attention.torch_backend import TorchAttention  # noqa: E402

from npu_reference import SENTINEL, fake_torch_npu  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- scenarios ---------------------------------------------------------------------------------
@dataclass
class Scenario:
    q_lens: list[int]
    s_lens: list[int]
    page: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_table: torch.Tensor  # int32 [N, max_blocks], shuffled pages, 0 where unused
    num_pages: int
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    q: torch.Tensor  # [T (+ padding), heads, head_dim]
    pad: int

    @property
    def context(self) -> list[int]:
        return [s - q for q, s in zip(self.q_lens, self.s_lens)]

    def spec(self, layers: int = 1, **kw) -> AttentionSpec:
        t = len(self.q) + 4
        return AttentionSpec(num_layers=layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
                             head_dim=self.head_dim, num_pages=self.num_pages, page_size=self.page, dtype=self.dtype,
                             max_tokens=t, max_seqs=max(len(self.q_lens), t), max_blocks=self.block_table.shape[1],
                             **kw)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's keys and values, padded like q (padding goes to slot 0)."""
        k = torch.cat([k[c:] for k, c in zip(self.keys, self.context)])
        v = torch.cat([v[c:] for v, c in zip(self.values, self.context)])
        if self.pad:
            k = torch.cat([k, torch.randn(self.pad, *k.shape[1:]).to(k.dtype)])
            v = torch.cat([v, torch.randn(self.pad, *v.shape[1:]).to(v.dtype)])
        return k, v

    def meta(self, host: bool = True) -> AttentionMetadata:
        meta = AttentionMetadata.from_lengths(self.q_lens, self.s_lens, self.block_table, self.page,
                                              pad_tokens_to=len(self.q))
        if not host:
            meta.query_lens_host = meta.seq_lens_host = None
        return meta


def make_scenario(q_lens, s_lens, page, heads, kv_heads, head_dim, dtype=torch.float32, seed=0, pad=0,
                  spare_blocks=1) -> Scenario:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [math.ceil(s / page) for s in s_lens]
    max_blocks = max(need) + spare_blocks
    num_pages = sum(need) * 2 + 2  # ids spread over twice the pages needed
    pages = rng.sample(range(1, num_pages), sum(need))  # shuffled, never page 0
    table = torch.zeros(len(s_lens), max_blocks, dtype=torch.int32)
    for s, n in enumerate(need):
        table[s, :n] = torch.tensor([pages.pop() for _ in range(n)], dtype=torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [rand(s, kv_heads, head_dim) for s in s_lens]
    values = [rand(s, kv_heads, head_dim) for s in s_lens]
    q = rand(sum(q_lens) + pad, heads, head_dim)
    return Scenario(list(q_lens), list(s_lens), page, heads, kv_heads, head_dim, dtype, table, num_pages, keys, values,
                    q, pad)


def dense_reference(sc: Scenario) -> torch.Tensor:
    """Full K/V per sequence, causal softmax, float64. [sum(q_lens), heads, head_dim]."""
    group = sc.heads // sc.kv_heads
    outs, t = [], 0
    for ql, sl, k, v in zip(sc.q_lens, sc.s_lens, sc.keys, sc.values):
        q = sc.q[t:t + ql].double()
        t += ql
        kr = k.double().repeat_interleave(group, 1)
        vr = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q, kr) * sc.head_dim ** -0.5
        visible = torch.arange(sl)[None, :] <= torch.arange(sl - ql, sl)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vr))
    return torch.cat(outs)


def write_context(backend, sc: Scenario, layer: int = 0, device="cpu") -> None:
    """What earlier steps left in the cache: every position before the new tokens, written in
    two steps (a chunk boundary inside the context)."""
    ctx = sc.context
    first = [c // 2 for c in ctx]
    for lo_list, hi_list in ((([0] * len(ctx)), first), (first, ctx)):
        counts = [hi - lo for lo, hi in zip(lo_list, hi_list)]
        if not sum(counts):
            continue
        meta = AttentionMetadata.from_lengths(counts, hi_list, sc.block_table, sc.page, device=device)
        k = torch.cat([k[lo:hi] for k, lo, hi in zip(sc.keys, lo_list, hi_list)]).to(device)
        v = torch.cat([v[lo:hi] for v, lo, hi in zip(sc.values, lo_list, hi_list)]).to(device)
        backend.write_kv(layer, k, v, meta.slot_mapping)


def run_step(backend, sc: Scenario, device="cpu", layer: int = 0, host: bool = True, use_out: bool = False):
    write_context(backend, sc, layer, device)
    meta = sc.meta(host)
    meta = AttentionMetadata(*(getattr(meta, f).to(device) for f in
                               ("query_start_loc", "seq_lens", "block_table", "slot_mapping")),
                             meta.max_query_len, meta.max_seq_len, meta.query_lens_host, meta.seq_lens_host)
    k, v = (x.to(device) for x in sc.new_kv())
    q = sc.q.to(device)
    step = backend.plan(meta)
    out = torch.full_like(q, float("nan")) if use_out else None
    result = backend.forward(layer, q, k, v, step, out=out)
    if use_out:
        assert result.data_ptr() == out.data_ptr()
    return result[:sum(sc.q_lens)].cpu(), step


def torch_backend(sc: Scenario, layers: int = 1, **kw) -> TorchAttention:
    """With `decode_mirror=True` the mirror serves every decode step, however small."""
    if kw.get("decode_mirror"):
        kw.setdefault("mirror_min_bytes", 0)
    return TorchAttention(sc.spec(layers), "cpu", **kw).allocate()


# Mixed steps: decode rows (q_len 1), prefill chunks without cached context (q_len == seq_len),
# chunks whose cached context ends on a page boundary and inside a page, padding tokens.
CASES = {
    "decode_g4_hd64_p16": dict(q_lens=[1, 1, 1, 1], s_lens=[1, 17, 128, 300], page=16, heads=8, kv_heads=2,
                               head_dim=64),
    "mixed_g1_hd24_p16": dict(q_lens=[1, 5, 16, 1, 40, 3], s_lens=[37, 5, 48, 1, 75, 19], page=16, heads=4,
                              kv_heads=4, head_dim=24, pad=3),
    "mixed_g2_hd128_p32": dict(q_lens=[9, 1, 33, 2], s_lens=[73, 64, 96, 2], page=32, heads=4, kv_heads=2,
                               head_dim=128),
    "mixed_g4_hd80_p128": dict(q_lens=[1, 24, 7, 1], s_lens=[2500, 152, 135, 129], page=128, heads=8, kv_heads=2,
                               head_dim=80),
}


# ---- torch backend vs the dense reference ------------------------------------------------------
@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_backend_matches_dense_reference(name, mirror):
    sc = make_scenario(**CASES[name])
    out, step = run_step(torch_backend(sc, decode_mirror=mirror), sc, use_out=mirror)
    torch.testing.assert_close(out.double(), dense_reference(sc), atol=2e-5, rtol=1e-4)
    if name.startswith("decode"):
        assert ("mirror" if mirror else "decode") in step.extra


def test_torch_decode_mirror_attends_over_the_longest_row_not_the_last_page():
    """Keys past the longest row are masked: the mirror reads 160 keys here, not 2 pages of 128."""
    sc = make_scenario(q_lens=[1, 1, 1], s_lens=[1, 97, 145], page=128, heads=4, kv_heads=2, head_dim=64, seed=5)
    out, step = run_step(torch_backend(sc, decode_mirror=True), sc, use_out=True)
    assert step.extra["mirror"]["ctx"] == 160
    torch.testing.assert_close(out.double(), dense_reference(sc), atol=2e-5, rtol=1e-4)


def test_torch_backend_long_context_and_host_reads():
    """Contexts of a few thousand positions; lengths read from the device when the caller
    gives no host copies."""
    sc = make_scenario(q_lens=[1, 64, 1], s_lens=[3000, 2112, 1999], page=128, heads=4, kv_heads=1, head_dim=64, seed=3)
    out, _ = run_step(torch_backend(sc, decode_mirror=False), sc, host=False)
    torch.testing.assert_close(out.double(), dense_reference(sc), atol=2e-5, rtol=1e-4)


def test_torch_backend_bfloat16_close_to_reference():
    sc = make_scenario(**CASES["mixed_g2_hd128_p32"], dtype=torch.bfloat16)
    out, _ = run_step(torch_backend(sc), sc)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(sc), atol=3e-2, rtol=3e-2)


def test_torch_decode_mirror_follows_steps_admissions_and_idle_rows():
    """Several decode steps of a batch whose rows change: a row prefills in the middle (which
    makes the mirror stale), an idle row writes to the scratch page, and a row crosses into a
    fresh page. Each step matches the gather path and the dense reference."""
    heads, kvh, hd, page, layers = 4, 2, 16, 8, 2
    rng = torch.Generator().manual_seed(7)
    spec = AttentionSpec(num_layers=layers, num_heads=heads, num_kv_heads=kvh, head_dim=hd, num_pages=40,
                         page_size=page, dtype=torch.float32, max_tokens=16, max_seqs=4, max_blocks=6)
    # The mirror takes decode steps of contexts past 10 positions (a step gathers whole pages).
    threshold = layers * 2 * 3 * 2 * page * kvh * hd * 4
    mirror = TorchAttention(spec, "cpu", decode_mirror=True, mirror_min_bytes=threshold).allocate()
    plain = TorchAttention(spec, "cpu", decode_mirror=False).allocate()
    assert mirror.decode_mirror and not plain.decode_mirror
    paths = []
    free = list(range(39, 0, -1))
    random.Random(1).shuffle(free)
    table = torch.zeros(3, 6, dtype=torch.int32)
    history = {r: ([], []) for r in range(3)}  # per row, per layer stacked K and V (layer in dim 1)

    def ensure_pages(row, length):
        for b in range(math.ceil(length / page)):
            if table[row, b] == 0:
                table[row, b] = free.pop()

    def step(q_lens, s_lens, idle=()):
        for r, sl in enumerate(s_lens):
            if r not in idle:
                ensure_pages(r, sl)
        meta = AttentionMetadata.from_lengths(q_lens, s_lens, table, page)
        for r in idle:  # an idle row writes to the scratch page, as the runtime's idle rows do
            meta.slot_mapping[sum(q_lens[:r])] = 0
        t = sum(q_lens)
        q = torch.randn(t, heads, hd, generator=rng)
        kv = torch.randn(layers, 2, t, kvh, hd, generator=rng)
        outs = []
        for backend in (mirror, plain):
            plan = backend.plan(meta)
            outs.append([backend.forward(layer, q, kv[layer, 0], kv[layer, 1], plan) for layer in range(layers)])
            if backend is mirror:
                paths.append(next(p for p in ("mirror", "decode", "general") if p in plan.extra))
        start = 0
        for r, (ql, sl) in enumerate(zip(q_lens, s_lens)):
            ks, vs = history[r]
            if ql == sl:
                ks.clear(), vs.clear()
            ks.append(kv[:, 0, start:start + ql])
            vs.append(kv[:, 1, start:start + ql])
            if r not in idle:
                for layer in range(layers):
                    sc = Scenario([ql], [sl], page, heads, kvh, hd, torch.float32, table[r:r + 1], 40,
                                  [torch.cat(ks, 1)[layer]], [torch.cat(vs, 1)[layer]], q[start:start + ql], 0)
                    ref = dense_reference(sc)
                    for out in outs:
                        torch.testing.assert_close(out[layer][start:start + ql].double(), ref, atol=2e-5, rtol=1e-4)
            start += ql
        return outs

    step([5, 3, 1], [5, 3, 1])  # prefill of three rows
    lens = [5, 3, 1]
    for _ in range(6):  # steady decode; row 0 crosses a page boundary at position 8
        lens = [n + 1 for n in lens]
        step([1, 1, 1], lens)
    # Row 2 is replaced by a new prompt (pages reused), row 1 goes idle and writes slot 0.
    for b in range(6):
        if table[2, b]:
            free.append(int(table[2, b]))
            table[2, b] = 0
    lens[2] = 6
    step([1, 1, 6], [lens[0] + 1, lens[1] + 1, 6])
    lens = [lens[0] + 1, lens[1] + 1, 6]
    for _ in range(3):
        lens = [lens[0] + 1, lens[1], lens[2] + 1]  # row 1 idle: its length stays
        step([1, 1, 1], lens, idle=(1,))
    # Pages, until the step that gathers two pages per row; a prefill; the mirror catches up.
    assert paths == ["general"] + ["decode"] * 3 + ["mirror"] * 3 + ["general"] + ["mirror"] * 3
    # A direct write after the plan makes the mirror stale: attention falls back to the pages.
    meta = AttentionMetadata.from_lengths([1, 1, 1], [n + 1 for n in lens], table, page)
    plan = mirror.plan(meta)
    q = torch.randn(3, heads, hd, generator=rng)
    k, v = torch.randn(2, 3, kvh, hd, generator=rng)
    mirror.write_kv(0, k, v, meta.slot_mapping)
    plain.write_kv(0, k, v, meta.slot_mapping)
    torch.testing.assert_close(mirror.attend(0, q, plan), plain.attend(0, q, plain.plan(meta)))


def test_torch_decode_mirror_reads_what_the_pages_hold_when_slots_disagree():
    """Steps whose slot mapping does not follow the block table: a token sent to the scratch
    page (an idle row; its own output is unspecified), or one written into another row's page
    (breaking the contract; that step's output is unspecified). Every row the contract covers
    then, and every row in the steps after, reads what the pages hold, as the gather path does."""
    spec = AttentionSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, num_pages=8, page_size=4,
                         dtype=torch.float32, max_tokens=8, max_seqs=2, max_blocks=3)
    mirror = TorchAttention(spec, "cpu", decode_mirror=True, mirror_min_bytes=0).allocate()
    plain = TorchAttention(spec, "cpu", decode_mirror=False).allocate()
    table = torch.tensor([[3, 5, 0], [6, 2, 0]], dtype=torch.int32)
    rng = torch.Generator().manual_seed(3)

    def step(q_lens, s_lens, slots=None, rows=slice(None)):
        meta = AttentionMetadata.from_lengths(q_lens, s_lens, table[:len(q_lens)], 4)
        if slots is not None:
            meta.slot_mapping = torch.tensor(slots)
        t = sum(q_lens)
        q = torch.randn(t, 2, 8, generator=rng)
        k, v = torch.randn(2, t, 1, 8, generator=rng)
        a = mirror.forward(0, q, k, v, mirror.plan(meta))
        b = plain.forward(0, q, k, v, plain.plan(meta))
        torch.testing.assert_close(a[rows], b[rows])

    step([3, 3], [3, 3])
    step([1, 1], [4, 4])
    # Row 0 finishes and the batch is compacted: row 1 moves to index 0 at the same length,
    # so only its pages tell the mirror that index 0 now holds another sequence.
    table = table[[1, 0]].contiguous()
    step([1], [5])
    step([1, 1], [6, 5])
    table = table[[1, 0]].contiguous()
    step([1, 1], [6, 7])
    step([3, 2], [3, 2])
    step([1, 1], [4, 3])
    step([1, 1], [5, 4], slots=[0, 27], rows=[1])  # row 0's token to the scratch page: position 4 stays unwritten
    step([1, 1], [6, 5])
    step([1, 1], [7, 6], slots=[22, 13], rows=[])  # row 1's token lands in row 0's page 3
    step([1, 1], [8, 7])


def test_decode_mirror_is_cpu_only_and_bounded():
    sc = make_scenario(**CASES["decode_g4_hd64_p16"])
    with pytest.raises(ValueError, match="decode_mirror"):
        TorchAttention(sc.spec(), "cuda", decode_mirror=True)
    assert not TorchAttention(sc.spec(), "cpu", mirror_budget_bytes=16).decode_mirror
    assert "mirror" not in TorchAttention(sc.spec(), "cuda").workspace_shapes


def test_metadata_and_spec_errors():
    table = torch.tensor([[3, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="query length"):
        AttentionMetadata.from_lengths([4], [3], table, 16)
    with pytest.raises(ValueError, match="pages"):
        AttentionMetadata.from_lengths([1], [40], table, 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        AttentionSpec(num_layers=1, num_heads=6, num_kv_heads=4, head_dim=8, num_pages=4, page_size=16,
                      dtype=torch.float32, max_tokens=4, max_seqs=4, max_blocks=2)
    sc = make_scenario(**CASES["decode_g4_hd64_p16"])
    backend = torch_backend(sc)
    with pytest.raises(ValueError, match="kv_cache"):
        TorchAttention(sc.spec(), "cpu").bind(torch.zeros(3))
    big = AttentionMetadata.from_lengths([1] * 4, [1] * 4, torch.zeros(4, 1, dtype=torch.int32), 16)
    big.max_seq_len = sc.spec().max_context + 1
    with pytest.raises(ValueError, match="max_seq_len"):
        backend.plan(big)


# ---- triton backend vs the torch backend -------------------------------------------------------
def triton_vs_torch(sc: Scenario, layers: int = 1, atol: float = 1e-3, **opts):
    from chip_child.attention.triton_backend import TritonAttention

    ref, _ = run_step(torch_backend(sc, layers), sc, layer=layers - 1)
    tri = TritonAttention(sc.spec(layers), TRITON_DEVICE, **opts).allocate()
    out, step = run_step(tri, sc, device=TRITON_DEVICE, layer=layers - 1, use_out=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    return step


# Every torch case, plus key tiles smaller than, equal to and larger than a page.
TRITON_RUNS = {**{name: (case, None) for name, case in CASES.items()},
               "mixed_g2_hd128_p32_tile128": (CASES["mixed_g2_hd128_p32"], 128),
               "mixed_g4_hd80_p128_tile32": (dict(q_lens=[1, 12, 1], s_lens=[700, 140, 129], page=128, heads=8,
                                                  kv_heads=2, head_dim=80, pad=2), 32),
               "decode_g4_hd64_p16_tile16": (dict(q_lens=[1, 1, 1], s_lens=[1, 17, 130], page=16, heads=8,
                                                  kv_heads=2, head_dim=64), 16)}


@needs_triton
@pytest.mark.parametrize("name", list(TRITON_RUNS))
def test_triton_matches_torch(name):
    case, block_n = TRITON_RUNS[name]
    triton_vs_torch(make_scenario(**case), layers=2, block_n=block_n)


@needs_triton
def test_triton_tiles_spanning_pages_and_gqa_group_of_three():
    """Key tiles larger than a page (several pages per tile), and 3 query heads per kv head
    (rows of a tile are (token, head) pairs that do not fill a power of two)."""
    sc = make_scenario(q_lens=[1, 7, 1], s_lens=[90, 40, 5], page=16, heads=6, kv_heads=2, head_dim=32, seed=5)
    triton_vs_torch(sc, block_n=64)


@needs_triton
def test_triton_split_kv_matches_torch():
    """Flash-decoding: a long decode row, a short one whose later splits are empty, and a
    two-token row (speculative-style), with the split count from the heuristic and forced."""
    sc = make_scenario(q_lens=[1, 1, 2], s_lens=[2000, 5, 300], page=128, heads=4, kv_heads=2, head_dim=64, seed=11)
    step = triton_vs_torch(sc, keys_per_split=512, block_n=128)
    assert step.extra["splits"] == 4
    sc = make_scenario(q_lens=[1, 1, 1], s_lens=[333, 64, 1], page=16, heads=4, kv_heads=4, head_dim=80, seed=12)
    step = triton_vs_torch(sc, num_kv_splits=3, block_n=32)
    assert step.extra["splits"] == 3


if HAS_TRITON:  # a kernel's globals are its module's, so the test kernel lives here
    import triton
    import triton.language as tl

    from chip_child.attention.triton_kernels import e4m3_to_float

    @triton.jit
    def decode_e4m3(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, e4m3_to_float(tl.load(src + i)))


@needs_triton
def test_triton_decodes_every_finite_e4m3_byte_exactly():
    fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = torch.isfinite(fp8.float())  # 0x7f and 0xff are NaN: a write saturates before them
    got = torch.empty(256, device=TRITON_DEVICE)
    decode_e4m3[(1,)](fp8.view(torch.uint8).to(TRITON_DEVICE), got, N=256)
    assert torch.equal(got.cpu()[finite], fp8.float()[finite])


FP8_RUNS = {"decode_g4_hd64_p16": (CASES["decode_g4_hd64_p16"], None, torch.float32),
            "mixed_g2_hd128_p32_bf16": (CASES["mixed_g2_hd128_p32"], None, torch.bfloat16),
            "mixed_g4_hd80_p128_split": (dict(q_lens=[1, 1, 2], s_lens=[700, 5, 300], page=128, heads=8, kv_heads=2,
                                              head_dim=80), 3, torch.float32)}


@needs_triton
@pytest.mark.parametrize("name", list(FP8_RUNS))
def test_triton_reads_an_fp8_cache_as_the_torch_backend_does(name):
    """kv_cache_dtype='fp8': both backends round K/V once into float8 pages; the triton kernel
    decodes them in its tiles, so its output is the torch backend's on the same fp8 cache (and
    its cache bytes equal the torch backend's rounding)."""
    from chip_child.attention.triton_backend import TritonAttention

    case, splits, dtype = FP8_RUNS[name]
    sc = make_scenario(**case, dtype=dtype, seed=3)
    spec = sc.spec(2, cache_dtype=torch.float8_e4m3fn)
    ref, _ = run_step(TorchAttention(spec, "cpu").allocate(), sc, layer=1)
    tri = TritonAttention(spec, TRITON_DEVICE, num_kv_splits=splits).allocate()
    out, step = run_step(tri, sc, device=TRITON_DEVICE, layer=1, use_out=True)
    assert tri.kv_cache.dtype == torch.float8_e4m3fn and step.extra["splits"] == (splits or 1)
    atol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    full, _ = run_step(TorchAttention(sc.spec(2), "cpu").allocate(), sc, layer=1)
    assert (out.float() - full.float()).abs().max() > 0  # the fp8 rounding is really in the path
    slots = sc.meta().slot_mapping[:sum(sc.q_lens)]
    k, _ = tri.read_kv(1, slots)
    new_k, _ = sc.new_kv()
    assert k.dtype == dtype and torch.equal(k.cpu(), new_k[:len(slots)].to(torch.float8_e4m3fn).to(dtype))


@needs_triton
def test_triton_write_kernel_is_exact():
    from chip_child.attention.triton_backend import TritonAttention

    for dtype in (torch.float32, torch.bfloat16):
        spec = AttentionSpec(num_layers=2, num_heads=6, num_kv_heads=3, head_dim=24, num_pages=9, page_size=16,
                             dtype=dtype, max_tokens=32, max_seqs=8, max_blocks=4)
        tri = TritonAttention(spec, TRITON_DEVICE).allocate()
        fused = torch.randn(20, 6 + 2 * 3, 24).to(dtype)  # q, k, v side by side, as the model's projection
        k, v = fused[:, 6:9], fused[:, 9:]
        slots = torch.randperm(8 * 16)[:20] + 16  # never page 0, in no order
        tri.write_kv(1, k.to(TRITON_DEVICE), v.to(TRITON_DEVICE), slots.to(TRITON_DEVICE))
        got_k, got_v = tri.read_kv(1, slots)
        assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
        assert tri.kv_cache[0].abs().sum() == 0  # the other layer is untouched
        written = torch.zeros(9 * 16, dtype=torch.bool)
        written[slots] = True
        others_k, others_v = tri.read_kv(1, torch.arange(9 * 16)[~written])
        assert others_k.abs().sum() == 0 and others_v.abs().sum() == 0


@needs_triton
def test_triton_bfloat16_close_to_torch():
    sc = make_scenario(**CASES["mixed_g2_hd128_p32"], dtype=torch.bfloat16, seed=2)
    triton_vs_torch(sc, atol=2e-2)


# ---- npu backend (through the stand-in torch_npu) vs the torch backend ----------------------------
@pytest.fixture
def npu(monkeypatch):
    mod = fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


def npu_vs_torch(sc: Scenario, **opts):
    from chip_child.attention.npu_backend import NpuAttention

    ref, _ = run_step(torch_backend(sc), sc)
    out, step = run_step(NpuAttention(sc.spec(), "cpu", **opts).allocate(), sc, use_out=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return step


def test_npu_prefill_and_mixed_steps_use_tnd(npu):
    sc = make_scenario(q_lens=[1, 40, 3, 1], s_lens=[300, 40, 131, 1], page=128, heads=8, kv_heads=2, head_dim=64,
                       dtype=torch.bfloat16, pad=2)
    step = npu_vs_torch(sc)
    assert step.extra["layout"] == "TND"
    name, kw = npu.calls[-1]
    assert name == "npu_fused_infer_attention_score"
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["block_size"] == 128
    assert kw["actual_seq_lengths"] == [1, 41, 44, 45]  # cumulative query ends
    assert kw["actual_seq_lengths_kv"] == [300, 40, 131, 1]  # per sequence
    assert kw["block_table"].dtype == torch.int32
    assert kw["num_heads"] == 8 and kw["num_key_value_heads"] == 2
    assert "npu_scatter_pa_kv_cache" in [c[0] for c in npu.calls]


def test_npu_decode_uses_bsh(npu):
    sc = make_scenario(q_lens=[1, 1, 1], s_lens=[1, 129, 700], page=128, heads=4, kv_heads=4, head_dim=128,
                       dtype=torch.float16)
    step = npu_vs_torch(sc)
    assert step.extra["layout"] == "BSH"
    name, kw = npu.calls[-1]
    assert kw["input_layout"] == "BSH" and "sparse_mode" not in kw and kw["actual_seq_lengths_kv"] == [1, 129, 700]


def test_npu_falls_back_to_reshape_and_cache(monkeypatch):
    mod = fake_torch_npu(with_scatter=False)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    sc = make_scenario(q_lens=[2, 1], s_lens=[130, 5], page=128, heads=4, kv_heads=2, head_dim=80,
                       dtype=torch.bfloat16, seed=4)
    npu_vs_torch(sc)
    assert "_npu_reshape_and_cache" in [c[0] for c in mod.calls]


def test_npu_decode_only_page_16(npu):
    from chip_child.attention.npu_backend import NpuAttention

    sc = make_scenario(q_lens=[1, 1], s_lens=[40, 3], page=16, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    npu_vs_torch(sc, decode_only=True)
    prefill = make_scenario(q_lens=[3], s_lens=[3], page=16, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_size"):
        run_step(NpuAttention(prefill.spec(), "cpu", decode_only=True).allocate(), prefill)


def test_npu_refuses_what_torch_npu_cannot_do(npu):
    from chip_child.attention.npu_backend import NpuAttention

    def spec(**kw):
        base = dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64, num_pages=8, page_size=128,
                    dtype=torch.bfloat16, max_tokens=8, max_seqs=4, max_blocks=2)
        return AttentionSpec(**{**base, **kw})

    with pytest.raises(ValueError, match="page_size"):
        NpuAttention(spec(page_size=64), "cpu")  # the fused prefill path needs a multiple of 128
    with pytest.raises(ValueError, match="page_size"):
        NpuAttention(spec(page_size=24), "cpu", decode_only=True)
    with pytest.raises(ValueError, match="page_size"):
        NpuAttention(spec(page_size=640), "cpu")
    with pytest.raises(ValueError, match="dtype"):
        NpuAttention(spec(dtype=torch.float32), "cpu")
    with pytest.raises(ValueError, match="head_dim"):
        NpuAttention(spec(head_dim=24), "cpu")
    NpuAttention(spec(page_size=256), "cpu")


def test_npu_reference_flags_duplicate_slots(npu):
    """The stand-in leaves a slot written twice in one call holding a sentinel, as the op
    promises nothing there; padding rows all write slot 0 and nothing valid reads it."""
    k = torch.ones(3, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16)
    npu.npu_scatter_pa_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 0, 17]))
    assert cache[0, 0].float().max() == SENTINEL and cache[1, 1].float().max() == 1


# ---- choosing a backend ----------------------------------------------------------------------------
def test_get_backend_defaults_and_overrides(monkeypatch):
    from chip_child.attention.npu_backend import NpuAttention

    assert get_backend("cpu", "torch") is TorchAttention
    assert get_backend("npu") is NpuAttention
    assert get_backend("cuda", "torch") is TorchAttention
    if HAS_TRITON:
        from chip_child.attention.triton_backend import TritonAttention

        assert get_backend("cuda") is TritonAttention
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert get_backend("cpu", "triton") is TritonAttention


def test_get_backend_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"attention_backend.*\('torch', 'cpu', 'triton', 'npu'\)"):
        get_backend("cpu", "flash")
    with pytest.raises(ValueError, match=r"attention_backend='npu' cannot run on cpu; choices for cpu"):
        get_backend("cpu", "npu")
    with pytest.raises(ValueError, match=r"attention_backend='npu' cannot run on cuda"):
        get_backend("cuda", "npu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run on cpu.*for cpu: \('torch', 'cpu'\)"):
        get_backend("cpu", "triton")
    with pytest.raises(ValueError, match="attention_backend: unknown device type"):
        get_backend("tpu")


# ---- the start-up self-check -------------------------------------------------------------------
def _runtime(path, **overrides):
    from chip_child.config import RuntimeConfig
    from chip_child.step.runtime import ChipRuntime

    return ChipRuntime(RuntimeConfig(str(path), device=TRITON_DEVICE, dtype="float32", max_batch_size=2,
                                     max_seq_len=64, page_size=8, decode_graphs=False, **overrides))


@needs_triton
def test_the_triton_backend_checks_itself_at_start_up(make_checkpoint) -> None:
    rt = _runtime(make_checkpoint("attn-check", num_attention_heads=4, num_key_value_heads=2), attention_backend="triton")
    (check,) = [v for v in rt.kernel_checks if v.kernel == "attention"]
    assert rt.attn.name == "triton" and check.used and check.error <= 1e-4


@needs_triton
def test_a_wrong_attention_backend_falls_back_to_the_torch_one_and_says_so(make_checkpoint, monkeypatch,
                                                                          capsys) -> None:
    from chip_child.attention.triton_backend import TritonAttention
    from chip_child.local import LocalDriver, LocalRequest

    path = make_checkpoint("attn-check", num_attention_heads=4, num_key_value_heads=2)
    real = TritonAttention.attend
    monkeypatch.setattr(TritonAttention, "attend", lambda self, *a, **k: real(self, *a, **k) * 0.5)  # injected
    rt = _runtime(path, attention_backend="triton")
    (check,) = [v for v in rt.kernel_checks if v.kernel == "attention"]
    assert rt.attn.name == "torch" and not check.used and check.error > 0.1
    assert "the triton attention backend failed its self-check" in capsys.readouterr().err
    prompts = [[3, 4, 5, 6, 7], list(range(10, 30))]
    got = LocalDriver(rt).run([LocalRequest(p, 6) for p in prompts]).token_ids
    monkeypatch.undo()
    want = LocalDriver(_runtime(path)).run([LocalRequest(p, 6) for p in prompts]).token_ids
    assert got == want
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "attention")  # forced: no check, the torch backend
    forced = _runtime(path, attention_backend="triton")
    assert forced.attn.name == "torch" and [(v.kernel, v.error, v.used) for v in forced.kernel_checks
                                            if v.kernel == "attention"] == [("attention", None, False)]
