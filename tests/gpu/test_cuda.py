"""The CUDA path on a real GPU: the triton and torch backends, eager and through decode graphs,
against transformers and against each other. Skipped where torch sees no CUDA device (CI); run
on a GPU machine with `python -m pytest tests/gpu/test_cuda.py`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from chip_child.config import RuntimeConfig
from chip_child.step.graphs import lane_buckets
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step.runtime import ChipRuntime
from l3worker import DistributedWorker, SamplingParams

from parity import assert_matches_transformers  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 24
# A prompt past the triton backend's 512 keys per split, so decode steps split the keys.
LENS = (1, 13, 40, 700)
# backend, decode graphs
PATHS = [("triton", True), ("triton", False), ("torch", True), ("torch", False)]


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    # Qwen3's head_dim and a GQA ratio of 4, small elsewhere.
    return make_checkpoint("cuda", seed=5, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                           max_position_embeddings=1024)


def prompts(lens, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def runtime(path: Path, backend: str, graphs: bool, dtype: str = "float32", page_size: int = 16) -> ChipRuntime:
    return ChipRuntime(RuntimeConfig(str(path), device="cuda", dtype=dtype, max_batch_size=4, max_seq_len=768,
                                     page_size=page_size, attention_backend=backend, decode_graphs=graphs))


@pytest.mark.parametrize("backend,graphs", PATHS, ids=[f"{b}-{'graphs' if g else 'eager'}" for b, g in PATHS])
def test_cuda_tokens_and_logits_match_transformers(ckpt, hf_model, backend: str, graphs: bool) -> None:
    model = hf_model(ckpt)
    rt = runtime(ckpt, backend, graphs)
    assert (rt.graphs is not None) == graphs
    if graphs:
        assert rt.graphs.lanes == lane_buckets(4)
    ps = prompts(LENS, model.config.vocab_size, seed=1)
    res = LocalDriver(rt).run([LocalRequest(p, NEW_TOKENS) for p in ps], keep_logits=True)
    assert_matches_transformers(model, ps, res.token_ids, res.logits, NEW_TOKENS)


def test_cuda_bfloat16_logits_track_transformers_in_bfloat16(ckpt) -> None:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    rt = runtime(ckpt, "triton", True, dtype="bfloat16")
    assert rt.attn.kv_cache.dtype == torch.bfloat16
    ps = prompts((13, 5, 300), model.config.vocab_size, seed=2)
    res = LocalDriver(rt).run([LocalRequest(p, 8) for p in ps], keep_logits=True)
    for prompt, tokens, logits in zip(ps, res.token_ids, res.logits):
        with torch.no_grad():
            want = model(torch.tensor([prompt + tokens[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float()
        mine = torch.stack(logits)
        rel = ((mine - want).abs().max() / want.abs().max()).item()
        assert rel <= 0.03, f"prompt length {len(prompt)}: relative logits error {rel:.2e} in bfloat16"


def live_tokens(ckpt, **kw) -> list[list[int]]:
    """Ten requests of mixed lengths through a chip-child on the GPU, greedy and seeded, more
    requests than rows."""
    ps = prompts((5, 70, 1, 33, 140, 9, 64, 17, 250, 3), 300, seed=3)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(ps))]
    options = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=512, page_size=16) | kw
    with DistributedWorker(ckpt, **options) as w:
        outs = w.generate(ps, params)
        decode = [r for r in w.step_records() if not r["prefill"]]
        # The steady state of a decode step on the device: no allocation, and without the
        # "always" policy's full-state copies no host-to-device copy.
        assert max(r["pool_allocs"] for r in decode) == 0
        if options.get("copy_policy", "dirty") == "dirty":
            assert min(r["h2d_copies"] for r in decode) == 0
    return [o.token_ids for o in outs]


def test_cuda_worker_paths_give_identical_tokens(ckpt) -> None:
    """Graphs on and off, both backends, both copy policies, pipeline depths, a small token budget
    (chunked prefill beside decoding rows) and a pool small enough to preempt: one set of tokens."""
    base = live_tokens(ckpt)
    variants = {
        "eager": dict(decode_graphs=False),
        "torch backend": dict(attention_backend="torch"),
        "copy_policy always": dict(copy_policy="always"),
        "pipeline depth 1": dict(pipeline_depth=1),
        "budget 16": dict(max_num_batched_tokens=16),
        "small pool": dict(num_pages=24),
    }
    for name, kw in variants.items():
        assert live_tokens(ckpt, **kw) == base, f"{name} changed the tokens"


# -- block FP8 kept as stored: W8A8 on the GPU ---------------------------------------------------------

FP8_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64)  # whole 128 x 128 blocks and K a multiple of 512: cuBLAS's recipe may take it


def fp8_run(path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, gemm: str | None = None):
    from chip_child.models import fp8_linear

    monkeypatch.undo()
    monkeypatch.setenv(fp8_linear.W8A8_ENV, "1")  # opt-in (fp8_linear.W8A8_ENV)
    if gemm is not None:
        monkeypatch.setattr(fp8_linear, "choose_gemm", lambda *a: gemm)
    # The torch reference runs eager: it is not written to be captured.
    rt = runtime(path, "triton", gemm != "torch", dtype=dtype)
    ps = prompts((5, 40, 130), 300, seed=4)
    return rt, LocalDriver(rt).run([LocalRequest(p, 12) for p in ps], keep_logits=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_block_fp8_runs_w8a8_on_the_stored_weights(make_checkpoint, tmp_path: Path, dtype: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A random block-FP8 checkpoint on the GPU keeps its projections fp8 and runs them through the
    chosen GEMM (F.scaled_mm where its probe passed, else our Triton kernel) and the forced Triton
    kernel, with logits close to the torch reference of the same W8A8 math on the same GPU while
    the tokens agree (see assert_tracks_reference)."""
    from chip_child.models.fp8 import FP8
    from chip_child.models.fp8_linear import Fp8Linear
    from test_fp8 import write_fp8_pair

    fp8_dir, _ = write_fp8_pair(make_checkpoint("cuda-fp8", seed=6, **FP8_SHAPE), tmp_path, (128, 128))
    rt, got = fp8_run(fp8_dir, dtype, monkeypatch)
    _, want = fp8_run(fp8_dir, dtype, monkeypatch, gemm="torch")
    layers = [getattr(lw, n) for lw in rt.weights.layers for n in ("qkv", "o_proj", "gate_up", "down")]
    assert all(isinstance(p, Fp8Linear) and p.weight.dtype == FP8 and p.weight.is_cuda for p in layers)
    chosen = {p.gemm for p in layers}
    print(f"{dtype}: gemm {chosen}")  # which one this torch and GPU took (-s shows it)
    results = {chosen.pop(): got}
    if "triton" not in results:
        results["triton"] = fp8_run(fp8_dir, dtype, monkeypatch, gemm="triton")[1]
    for name, res in results.items():
        assert_tracks_reference(res, want, name)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 130])
def test_cuda_fp8_gemms_match_the_reference_on_each_projection(make_checkpoint, tmp_path: Path, rows: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kept-fp8 projection of a model, through the Triton GEMM and (where cuBLAS takes the
    shape) F.scaled_mm, against reference_linear in fp32 on the same quantized activations.
    Measured on an H200 (2026-11-27): 2e-7 relative up to 17 rows, 2-3e-4 from 40 rows for both
    GEMMs alike, Hopper's fp8 tensor cores accumulating with about 14 bits; hence 2e-3."""
    import torch.nn.functional as F

    from chip_child.models.fp8_linear import Fp8Linear, reference_linear, scaled_mm_takes
    from test_fp8 import write_fp8_pair

    fp8_dir, _ = write_fp8_pair(make_checkpoint("cuda-fp8", seed=6, **FP8_SHAPE), tmp_path, (128, 128))
    rt, _ = fp8_run(fp8_dir, "float32", monkeypatch, gemm="triton")
    g = torch.Generator(device="cuda").manual_seed(rows)
    for name in ("qkv", "o_proj", "gate_up", "down"):
        p = getattr(rt.weights.layers[0], name)
        x = torch.randn(rows, p.weight.shape[1], device="cuda", generator=g)
        want = reference_linear(x, p.weight, p.scale_inv, p.block, torch.float32)
        gemms = ["triton"]
        if hasattr(F, "scaled_mm") and scaled_mm_takes(tuple(p.weight.shape), p.block) and rows % 16 == 0:
            gemms.append("scaled_mm")  # cuBLAS refused other row counts here (CUBLAS_STATUS_NOT_SUPPORTED)
        for gemm in gemms:
            got = Fp8Linear(p.weight, p.scale_inv, p.block, torch.float32, gemm)(x)
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel <= 2e-3, f"{name} {gemm} rows {rows}: relative error {rel:.2e}"


# W8A8 rounds every projection's input to e4m3 (3 mantissa bits). A last-bit difference before a
# rounding (a kernel's summation order, the fp8 tensor cores' accumulation) moves that input a whole
# e4m3 step, 6-12%, and on a random model such moves reach the logits: on an H200 (2026-11-27) the
# torch reference itself, eager against decode graphs, differed by up to 4.5% in bf16, and the Triton
# GEMM from it by up to 5.1% (fp32) and 7.0% (bf16) while each GEMM agreed to 3e-4. Hence 0.15, and
# only while the tokens agree: after a different token the inputs differ.
W8A8_LOGITS_REL_TOL = 0.15
# A MoE layer's router can also pick another expert on such a difference: the fused MoE was 0.18 from
# the per-expert path at one step there (fp32), its kernels equal their references under the
# interpreter and on the GPU (tests/models/test_fp8_moe.py).
W8A8_MOE_LOGITS_REL_TOL = 0.3


def assert_tracks_reference(res, want, name: str, tol: float = W8A8_LOGITS_REL_TOL) -> None:
    """Each request's logits within `tol` of the reference's (relative to its largest) at every step
    up to the first where the sampled tokens part, and at least one step compared."""
    for mine, ref, my_tokens, ref_tokens in zip(res.logits, want.logits, res.token_ids, want.token_ids):
        assert mine and ref
        for step, (a, b) in enumerate(zip(mine, ref)):
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert rel <= tol, f"{name}: step {step}: relative logits error {rel:.2e}"
            if my_tokens[step] != ref_tokens[step]:
                break


FP8_MOE_SHAPE = dict(FP8_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                     norm_topk_prob=True, mlp_only_layers=[1])  # a dense layer too: both kinds of fp8 layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_block_fp8_moe_runs_w8a8_experts_on_the_stored_weights(make_checkpoint, tmp_path: Path, dtype: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A random block-FP8 Qwen3-MoE checkpoint on the GPU keeps its experts fp8 (128 x 128 blocks) and
    runs them through our fused MoE's W8A8 kernels; against the torch reference of the same math
    (torch_moe on the same fp8 experts, the dense projections through the torch GEMM) as above."""
    from chip_child.models import fp8_linear
    from chip_child.models.fp8 import FP8
    from chip_child.models.fp8_experts import Fp8Experts
    from chip_child.models.moe import torch_moe
    from chip_child.models.moe_triton import triton_moe
    from test_fp8 import write_fp8_pair

    src = make_checkpoint("cuda-fp8-moe", seed=7, family="qwen3_moe", **FP8_MOE_SHAPE)
    fp8_dir, _ = write_fp8_pair(src, tmp_path, (128, 128))
    ps = prompts((5, 40, 130), 300, seed=4)
    monkeypatch.setenv(fp8_linear.W8A8_ENV, "1")  # opt-in (fp8_linear.W8A8_ENV)
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fp8_linear, "choose_gemm", lambda *a: "torch")
        rt = ChipRuntime(RuntimeConfig(str(fp8_dir), device="cuda", dtype=dtype, max_batch_size=4, max_seq_len=256,
                                       page_size=16, fused_kernels=fused))
        assert rt.ops.moe is (triton_moe if fused else torch_moe)
        experts = [getattr(lw.moe, n) for lw in rt.weights.layers if lw.moe is not None for n in ("gate_up", "down")]
        assert experts and all(isinstance(e, Fp8Experts) and e.weight.dtype == FP8 and e.weight.is_cuda
                               for e in experts)
        results[fused] = LocalDriver(rt).run([LocalRequest(p, 12) for p in ps], keep_logits=True)
    assert_tracks_reference(results[True], results[False], "fused W8A8 MoE", W8A8_MOE_LOGITS_REL_TOL)


def test_cuda_top_k_top_p_keep_the_cpus_sets_and_draw_its_tokens() -> None:
    """The filters sort in full on cuda (chip_child.sampling.top_k_top_p) and take candidates on
    the cpu: on the same peaked logits (no cutoff near a tie) both keep the same tokens and the
    seeded draw picks the same ones."""
    from chip_child.sampling.noise import vocab_hash
    from chip_child.sampling.sampler import sample, seed_key
    from chip_child.sampling.top_k_top_p import filter_rows, mask_below

    g = torch.Generator().manual_seed(0)
    n, vocab = 8, 151936
    x = torch.randn(n, vocab, generator=g) * 4
    top_k = torch.tensor([20, 0, 40, 1, 0, 20, 50, 0])
    top_p = torch.tensor([0.95, 0.9, 1.0, 1.0, 0.5, 0.8, 0.95, 1.0])
    keys = torch.tensor([seed_key(i) for i in range(n)])
    temperature, counters = torch.full((n,), 0.7), torch.arange(n) + 3
    kept, ids = {}, {}
    for device in ("cpu", "cuda"):
        a = [t.to(device) for t in (x, top_k, top_p, keys, temperature, counters)]
        kept[device] = mask_below(a[0], filter_rows(*a[:3]).cutoff).isfinite().cpu()
        ids[device] = sample(a[0], a[4], a[1], a[2], a[3], a[5], vocab_hash(vocab, torch.device(device)),
                             True, True).cpu()
    assert torch.equal(kept["cpu"], kept["cuda"])
    assert torch.equal(ids["cpu"], ids["cuda"])
