"""Block-FP8 weights kept as stored (chip_child.models.fp8_linear): the cuda decision, the loader's fp8
tensors, the model's projections, and the W8A8 kernels on the cpu under Triton's interpreter
against the torch reference of the same math (activation quantizer bit for bit, GEMM within fp32
accumulation). The cuda run itself is in tests/gpu/test_cuda.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # on cuda the kernels compile; these tests then skip
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from chip_child.models import fp8_linear  # noqa: E402
from chip_child.config import RuntimeConfig  # noqa: E402
from chip_child.models.fp8_kernels import _round_to_e4m3  # noqa: E402
from chip_child.models.fp8 import FP8, SCALE_SUFFIX, dequantize_blocks, quantize_blocks  # noqa: E402
from chip_child.models.fp8_linear import (Fp8Linear, keeps_fp8, projection, quantize_activations,  # noqa: E402
                                   quantize_groups, reference_linear, triton_gemm)
from chip_child.models.loader import load_config, load_weights  # noqa: E402
from chip_child.local import LocalDriver, LocalRequest  # noqa: E402
from chip_child.models.quant import BlockFp8  # noqa: E402
from chip_child.step.runtime import ChipRuntime  # noqa: E402

from test_fp8 import write_fp8_pair  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


# -- where fp8 is kept ------------------------------------------------------------------------------

def test_keeps_fp8_only_on_cuda_with_fp8_tensor_cores() -> None:
    q = BlockFp8((128, 128))
    assert keeps_fp8("cuda", q, (9, 0)) and keeps_fp8("cuda", q, (8, 9)) and keeps_fp8("cuda", q, (10, 0))
    assert not keeps_fp8("cuda", q, (8, 0))  # A100: no e4m3 tensor cores
    assert not keeps_fp8("cpu", q, None) and not keeps_fp8("npu", q, None) and not keeps_fp8("mps", q, None)
    assert not keeps_fp8("cuda", None, (9, 0))  # a plain checkpoint
    assert keeps_fp8("cuda", BlockFp8((128, 128), at_load=True), (9, 0))  # quantization="fp8"
    assert keeps_fp8("cuda", BlockFp8((16, 32)), (9, 0)) and keeps_fp8("cuda", BlockFp8((24, 16)), (9, 0))
    for cols in (8, 24, 96):  # the GEMM steps K by whole blocks: a power of two >= 16 columns
        assert not keeps_fp8("cuda", BlockFp8((128, cols)), (9, 0))


@pytest.fixture(scope="module")
def fp8_pair(make_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    return write_fp8_pair(make_checkpoint(), tmp_path_factory.mktemp("fp8-linear"), (16, 32))


def test_kept_fp8_is_opt_in_on_cuda_and_its_absence_is_said(monkeypatch, capsys) -> None:
    """W8A8 was slower than the dequantized weights where measured: without L3WORKER_FP8_W8A8=1 a
    cuda device with fp8 tensor cores dequantizes, and says so."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    cuda, quant = torch.device("cuda", 0), BlockFp8((128, 128))
    monkeypatch.delenv(fp8_linear.W8A8_ENV, raising=False)
    assert not fp8_linear.keeps_fp8_on(cuda, quant)
    assert "block-FP8 weights are dequantized at load on cuda:0" in capsys.readouterr().err
    monkeypatch.setenv(fp8_linear.W8A8_ENV, "1")
    assert fp8_linear.keeps_fp8_on(cuda, quant)
    assert not fp8_linear.keeps_fp8_on(torch.device("cpu"), quant) and capsys.readouterr().err == ""


def test_loader_keeps_the_stored_fp8_tensors_when_asked(fp8_pair) -> None:
    from safetensors.torch import load_file

    fp8_dir, _ = fp8_pair
    cfg = load_config(fp8_dir)
    stored = load_file(fp8_dir / "model.safetensors")
    plain = load_weights(fp8_dir, cfg, torch.float32)
    kept = load_weights(fp8_dir, cfg, torch.float32, keep_fp8=True)
    assert not any(n.endswith(SCALE_SUFFIX) for n in plain)  # the default: dequantized, as before
    assert list(kept)[:len(plain)] == list(plain)
    bits = lambda t: t.view(torch.uint8) if t.dtype == FP8 else t  # noqa: E731  (fp8 has no torch.equal)
    for name, t in kept.items():
        if name.endswith("_proj.weight") or name.endswith(SCALE_SUFFIX):
            assert t.dtype == stored[name].dtype and torch.equal(bits(t), bits(stored[name])), name
        else:
            assert torch.equal(t, plain[name]), name
    assert sum(n.endswith(SCALE_SUFFIX) for n in kept) == 2 * 7  # q, k, v, o, gate, up, down per layer


def test_loader_quantizes_at_load_into_kept_fp8(make_checkpoint) -> None:
    src = make_checkpoint()
    cfg = load_config(src, "fp8")
    kept = load_weights(src, cfg, torch.float32, keep_fp8=True)
    raw = load_weights(src, load_config(src), torch.float32)
    name = "model.layers.1.mlp.down_proj.weight"
    q, s = quantize_blocks(raw[name], (128, 128))
    assert kept[name].dtype == FP8 and torch.equal(kept[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(kept[name + SCALE_SUFFIX], s)


def test_projection_keeps_block_aligned_fp8_and_dequantizes_the_rest() -> None:
    g = torch.Generator().manual_seed(0)
    quant = BlockFp8((16, 32))
    state = {}
    for name, shape in {"a": (48, 64), "b": (40, 64)}.items():
        state[name], state[name + SCALE_SUFFIX] = quantize_blocks(torch.randn(*shape, generator=g), quant.block)
    every = slice(None)
    deq = {n: dequantize_blocks(state[n], state[n + SCALE_SUFFIX], quant.block, torch.float32) for n in "ab"}
    cols = slice(32, 64)
    fused = projection(state, [("a", slice(16, 48), cols), ("b", every, cols)], quant, torch.float32)
    assert isinstance(fused, Fp8Linear)
    assert torch.equal(dequantize_blocks(fused.weight, fused.scale_inv, quant.block, torch.float32),
                       torch.cat([deq["a"][16:48, 32:], deq["b"][:, 32:]]))
    # A ragged part before another (40 rows, blocks of 16) or a slice off the block edges: dequantized.
    for parts in ([("b", every, every), ("a", every, every)], [("a", slice(8, 40), every)]):
        plain = projection(state, parts, quant, torch.float32)
        assert isinstance(plain, torch.Tensor) and plain.dtype == torch.float32
        assert torch.equal(plain, torch.cat([deq[n][r, c] for n, r, c in parts]).t())


@pytest.mark.parametrize("world", [1, 2])
def test_model_projections_hold_the_dequantized_weights(fp8_pair, world: int) -> None:
    """Qwen3Weights.from_hf on kept fp8 (blocks of 16 x 32), whole and as tensor-parallel shards:
    each projection is an Fp8Linear whose blocks dequantize to the dequantized load's projection,
    or, where a shard cuts a block (k/v rows of 24, o_proj and down columns of 48), that matrix itself."""
    from chip_child.models.qwen3 import PROJECTIONS, Qwen3Weights

    fp8_dir, _ = fp8_pair
    cfg = load_config(fp8_dir)
    kept = load_weights(fp8_dir, cfg, torch.float32, keep_fp8=True)
    plain = load_weights(fp8_dir, cfg, torch.float32)
    kinds = set()
    for rank in range(world):
        got, want = (Qwen3Weights.from_hf(state, cfg, rank, world) for state in (kept, plain))
        for lw, ref in zip(got.layers, want.layers):
            for name in PROJECTIONS:
                p = getattr(lw, name)
                kinds.add((name, type(p).__name__))
                if isinstance(p, Fp8Linear):
                    p = dequantize_blocks(p.weight, p.scale_inv, p.block, torch.float32).t()
                assert torch.equal(p, getattr(ref, name)), (rank, name)
    fp8 = {name for name, kind in kinds if kind == "Fp8Linear"}
    assert fp8 == (set(PROJECTIONS) if world == 1 else {"gate_up"})


# -- the kernels under the interpreter --------------------------------------------------------------

@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _round_to_e4m3(tl.load(v_ptr + i, mask=i < n)), mask=i < n)


@interpreted
def test_rounding_to_e4m3_equals_torch_cast() -> None:
    """Every finite e4m3 value, every midpoint between neighbours (ties to even), just either side of
    each, and random values over the whole range: the kernel's rounding equals torch's cast."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids.nextafter(mids + 1), mids.nextafter(mids - 1)])
    rand = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2.3, 4096)
    v = torch.cat([grid, mids, near, rand.clamp(-448, 448)]).contiguous()
    out = torch.empty_like(v)
    _round_kernel[(-(-v.numel() // 1024),)](v, out, v.numel(), BLOCK=1024)
    want = v.to(FP8).float()
    assert torch.equal(out, want), v[out != want][:8]
    assert not torch.equal(mids.to(FP8).float(), grid[:-1])  # ties do round both ways: the midpoints test something


SHAPES = [(1, 256, 384, (128, 128)), (5, 200, 100, (16, 32)), (33, 64, 48, (24, 16)), (70, 96, 130, (128, 32))]


def _inputs(m: int, k: int, n: int, block: tuple[int, int]):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=g)]
    x[m // 2, :block[1]] = 0  # an all-zero group: the scale floor, zeros out
    w, s = quantize_blocks(torch.randn(n, k, generator=g) / 8, block)
    return x, w, s


@interpreted
@pytest.mark.parametrize("m, k, n, block", SHAPES)
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major scales", "column-major scales"])
def test_activation_quantizer_equals_the_reference(m: int, k: int, n: int, block, column_major: bool) -> None:
    x, _, _ = _inputs(m, k, n, block)
    for source in (x, x.bfloat16()):
        q, scale = quantize_activations(source, block[1], column_major)
        want_q, want_scale = quantize_groups(source, block[1])
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        assert scale.stride() == ((1, m) if column_major else (scale.shape[1], 1))


@interpreted
@pytest.mark.parametrize("m, k, n, block", SHAPES)
def test_block_fp8_gemm_matches_the_reference(m: int, k: int, n: int, block) -> None:
    x, w, s = _inputs(m, k, n, block)
    want = reference_linear(x, w, s, block, torch.float32)
    got = triton_gemm(*quantize_activations(x, block[1]), w, s, block, torch.float32)
    # The same products summed in another order: fp32 accumulation's error, not fp8's.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    layer = Fp8Linear(w, s, block, torch.bfloat16).to("cpu")
    assert layer.gemm == "triton"
    bias = torch.randn(n, dtype=torch.bfloat16)
    got16 = layer(x.bfloat16(), bias).float()
    want16 = reference_linear(x.bfloat16(), w, s, block, torch.bfloat16).float() + bias.float()
    # bf16 out: the interpreter truncates where torch rounds, one bf16 step either way.
    assert ((got16 - want16).abs().max() / want16.abs().max()).item() <= 2 ** -6
    assert layer(x[:0].bfloat16()).shape == (0, n)


# -- the model on kept fp8 weights -------------------------------------------------------------------

def _run(path: Path, kept: bool, monkeypatch: pytest.MonkeyPatch, gemm: str | None = None):
    monkeypatch.setattr("chip_child.step.runtime.keeps_fp8_on", lambda device, quant: kept)
    if gemm is not None:
        monkeypatch.setattr(fp8_linear, "choose_gemm", lambda *a: gemm)
    rt = ChipRuntime(RuntimeConfig(str(path), device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64,
                                   page_size=8, cpu_prepack=False, decode_graphs=False))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17)]
    return rt, LocalDriver(rt).run([LocalRequest(p, 8) for p in prompts], keep_logits=True)


def test_cpu_runtime_dequantizes(fp8_pair) -> None:
    rt = ChipRuntime(RuntimeConfig(str(fp8_pair[0]), device="cpu", dtype="float32", max_batch_size=2,
                                   max_seq_len=64, page_size=8))
    lw = rt.weights.layers[0]
    assert all(not isinstance(getattr(lw, n), Fp8Linear) for n in ("qkv", "o_proj", "gate_up", "down"))


@interpreted
def test_runtime_on_kept_fp8_runs_the_kernels_as_the_reference_math(fp8_pair, monkeypatch) -> None:
    """The runtime with fp8 kept (as on cuda; here the kernels interpreted): tokens of the torch
    reference of the same W8A8 math, fp32 logits within accumulation error."""
    rt, got = _run(fp8_pair[0], True, monkeypatch)
    lw = rt.weights.layers[1]
    assert all(getattr(lw, n).gemm == "triton" and getattr(lw, n).weight.dtype == FP8
               for n in ("qkv", "o_proj", "gate_up", "down"))
    checks = [(v.kernel, v.used) for v in rt.kernel_checks if v.kernel != "attention"]  # the cpu backend checks itself
    assert checks == [("fp8_gemm:triton", True)]  # passed its self-check
    _, want = _run(fp8_pair[0], True, monkeypatch, gemm="torch")
    assert got.token_ids == want.token_ids
    for mine, ref in zip(got.logits, want.logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(ref), rtol=1e-4, atol=1e-4)


@interpreted
def test_a_wrong_fp8_gemm_fails_its_self_check_and_the_reference_math_runs(fp8_pair, monkeypatch, capsys) -> None:
    real = fp8_linear.triton_gemm
    monkeypatch.setattr(fp8_linear, "triton_gemm", lambda *a, **k: real(*a, **k) * 0.5)  # injected error
    rt, got = _run(fp8_pair[0], True, monkeypatch)
    assert [(v.kernel, v.used) for v in rt.kernel_checks if v.kernel.startswith("fp8")] == [("fp8_gemm:triton", False)]
    assert all(getattr(lw, n).gemm == "torch" and getattr(lw, n).weight.dtype == FP8
               for lw in rt.weights.layers for n in ("qkv", "o_proj", "gate_up", "down"))
    assert "fp8 GEMM triton failed its self-check" in capsys.readouterr().err
    _, want = _run(fp8_pair[0], True, monkeypatch, gemm="torch")
    assert got.token_ids == want.token_ids


@interpreted
def test_scaled_mm_probe_accepts_the_recipe_only_with_the_right_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time probe of F.scaled_mm's blockwise recipe, with our GEMM standing in for cuBLAS:
    it passes when the scales are read as laid out, fails when either operand's scales are read from
    another block, and fails when the call raises."""
    def stand_in(mix_weight: bool = False, mix_activation: bool = False, fail: bool = False):
        def gemm(q, scale, weight, scale_inv_t, out_dtype):
            if fail:
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
            w_scale = scale_inv_t.t()
            return triton_gemm(q, scale.flip(1) if mix_activation else scale, weight,
                               w_scale.flip(0) if mix_weight else w_scale, (128, 128), out_dtype)
        return gemm

    for gemm, works in ((stand_in(), True), (stand_in(mix_weight=True), False),
                        (stand_in(mix_activation=True), False), (stand_in(fail=True), False)):
        monkeypatch.setattr(fp8_linear, "_scaled_mm", gemm)
        fp8_linear.scaled_mm_works.cache_clear()
        assert fp8_linear.scaled_mm_works(torch.device("cpu"), torch.bfloat16) is works
    fp8_linear.scaled_mm_works.cache_clear()


# Compiles both kernels for one capability and prints what the test checks; run in a child without
# TRITON_INTERPRET (under it @triton.jit makes interpreted functions, which cannot be compiled).
COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chip_child.models import fp8_kernels as k

target = GPUTarget("cuda", int(sys.argv[1]), 32)
quant = triton.compile(ASTSource(k.group_quant_kernel, constexprs={"GROUP": 128}, signature=dict(
    x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", cols="i32", stride_x="i32", stride_q="i32", stride_sm="i32",
    stride_sg="i32", GROUP="constexpr")), target=target)
print("quant div.rn", "div.rn.f32" in quant.asm["ptx"], "div.full", "div.full" in quant.asm["ptx"])
ints = ("M", "N", "K", "stride_am", "stride_asm", "stride_asg", "stride_bn", "stride_bsn", "stride_bsk", "stride_cm")
signature = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr="*bf16",
                 **dict.fromkeys(ints, "i32"))
for block_m, block_n in ((16, 64), (64, 128)):  # the decode and the prefill tiles
    consts = dict(GROUP_N=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128)
    gemm = triton.compile(ASTSource(k.block_fp8_gemm_kernel, constexprs=consts,
                                    signature=signature | dict.fromkeys(consts, "constexpr")), target=target)
    print("gemm", block_m, block_n, "cubin", "cubin" in gemm.asm)
"""


def compiles_in_child(script: str, capability: int) -> list[str]:
    """The lines `script` prints when run with the capability as its argument in a child without
    TRITON_INTERPRET (skips where this triton has no cuda backend)."""
    import subprocess

    pytest.importorskip("triton.backends.nvidia.compiler", reason="this triton has no cuda backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script, str(capability)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.parametrize("capability", [89, 90])
def test_kernels_compile_for_fp8_gpus(capability: int) -> None:
    """Both kernels compiled ahead of time for sm_89 and sm_90 (no GPU needed: Triton's own ptxas):
    the interpreter runs what a compiled kernel may not (it reads non-constexpr globals), so this
    checks the source a GPU would build. The quantizer divides with IEEE rounding (div.rn, not the
    approximate div.full Triton's `/` emits)."""
    assert compiles_in_child(COMPILE, capability) == ["quant div.rn True div.full False", "gemm 16 64 cubin True",
                                                      "gemm 64 128 cubin True"]
