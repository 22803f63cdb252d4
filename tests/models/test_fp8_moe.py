"""Block-FP8 MoE experts kept as stored (chip_child.models.fp8_experts): the loader's decision, the experts'
weights whole and as tensor/expert-parallel shards, and the fused MoE's W8A8 kernels on the cpu under
Triton's interpreter against the torch reference of the same math (dequantized expert weights times
per-group quantize-dequantized activations, fp32). The cuda run itself is in tests/gpu/test_cuda.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # on cuda the kernels compile; these tests then skip
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
pytest.importorskip("triton")

from chip_child.models.fp8 import FP8, SCALE_SUFFIX, dequantize_blocks, quantize_blocks  # noqa: E402
from chip_child.models.fp8_experts import Fp8Experts  # noqa: E402
from chip_child.models.fp8_linear import keeps_fp8, quantize_groups  # noqa: E402
from chip_child.models.loader import load_config, load_weights  # noqa: E402
from chip_child.models.moe import MoeConfig, MoeWeights, torch_moe  # noqa: E402
from chip_child.models.moe_triton import triton_moe  # noqa: E402
from chip_child.models.quant import BlockFp8  # noqa: E402

from test_fp8 import write_fp8_pair  # noqa: E402
from test_fp8_linear import compiles_in_child  # noqa: E402
from test_moe import split_experts  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
BLOCK = (16, 32)  # small blocks: several per expert matrix at interpreter-friendly sizes
PREFIX = "model.layers.0.mlp."


def fp8_state(num_experts: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sparse layer's tensors as a block-FP8 checkpoint stores them (the router plain)."""
    g = torch.Generator().manual_seed(seed)
    state = {PREFIX + "gate.weight": torch.randn(num_experts, hidden, generator=g) * 1.5}
    for e in range(num_experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            key = f"{PREFIX}experts.{e}.{name}.weight"
            state[key], state[key + SCALE_SUFFIX] = quantize_blocks(torch.randn(*shape, generator=g) * 0.3, BLOCK)
    return state


def dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: dequantize_blocks(t, state[n + SCALE_SUFFIX], BLOCK, torch.float32) if t.dtype == FP8 else t
            for n, t in state.items() if not n.endswith(SCALE_SUFFIX)}


def layer(state, moe: MoeConfig, inter: slice = slice(None), experts: slice | None = None) -> MoeWeights:
    return MoeWeights.from_hf(state, PREFIX, moe, inter, experts, BlockFp8(BLOCK))


def moe_config(num_experts: int, top_k: int, inter: int) -> MoeConfig:
    return MoeConfig(num_experts, top_k, inter, True, (0,))


def test_loader_keeps_expert_fp8_only_where_the_cuda_decision_does(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint("fp8-moe", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True)
    fp8_dir, _ = write_fp8_pair(src, tmp_path, BLOCK)
    cfg = load_config(fp8_dir)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    for capability, kept in (((9, 0), True), ((8, 9), True), ((8, 0), False)):
        state = load_weights(fp8_dir, cfg, torch.float32, keep_fp8=keeps_fp8("cuda", cfg.quantization, capability))
        assert (state[name].dtype == FP8) is kept and (name + SCALE_SUFFIX in state) is kept, capability
        assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays plain
    state = load_weights(fp8_dir, cfg, torch.float32, keep_fp8=keeps_fp8("cpu", cfg.quantization, None))
    assert state[name].dtype == torch.float32 and not any(n.endswith(SCALE_SUFFIX) for n in state)


@pytest.mark.parametrize("world, shard_kind", [(1, Fp8Experts), (2, Fp8Experts), (4, torch.Tensor)])
def test_expert_weights_keep_fp8_on_block_edges_and_dequantize_shards_off_them(world: int, shard_kind: type) -> None:
    """Tensor-parallel shards of the intermediate dimension (64: 64 / 32 / 16 per rank): kept fp8
    where the shard holds whole blocks of gate/up rows (16) and down columns (32), else that
    projection dequantized; either way the dequantized load's weights, exactly."""
    state = fp8_state(4, 64, 64)
    moe = moe_config(4, 2, 64)
    step = 64 // world
    for rank in range(world):
        inter = slice(rank * step, (rank + 1) * step)
        got, want = layer(state, moe, inter), layer(dequantized(state), moe, inter)
        assert isinstance(got.gate_up, Fp8Experts) and isinstance(got.down, shard_kind)
        assert got.gate_up.shape == want.gate_up.shape and got.down.shape == want.down.shape
        for mine, ref in ((got.gate_up, want.gate_up), (got.down, want.down)):
            if isinstance(mine, Fp8Experts):
                mine = torch.stack([dequantize_blocks(w, s, BLOCK, torch.float32).t()
                                    for w, s in zip(mine.weight, mine.scale_inv)])
            assert torch.equal(mine, ref)


def test_torch_moe_on_fp8_experts_is_the_dequantized_weights_times_quantized_activations() -> None:
    """The reference itself: each expert's input quantize-dequantized per group of 32, times the
    dequantized weights, in fp32."""
    state = fp8_state(4, 64, 32)
    moe = moe_config(4, 2, 32)
    fp8, plain = layer(state, moe), layer(dequantized(state), moe)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))

    def qdq(a: torch.Tensor) -> torch.Tensor:
        q, s = quantize_groups(a, BLOCK[1])
        return q.float() * s.repeat_interleave(BLOCK[1], 1)

    want = torch.zeros_like(x)
    weights, ids = torch.softmax(x @ plain.router, -1).topk(2, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    for t in range(x.shape[0]):
        for j in range(2):
            e = ids[t, j]
            gate, up = (qdq(x[t:t + 1]) @ plain.gate_up[e]).chunk(2, -1)
            want[t] += weights[t, j] * (qdq(torch.nn.functional.silu(gate) * up) @ plain.down[e])[0]
    torch.testing.assert_close(torch_moe(x, fp8), want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (9, 6, 3), (20, 8, 1)])
def test_fused_moe_w8a8_matches_the_reference(tokens: int, experts: int, top_k: int) -> None:
    state = fp8_state(experts, 64, 64, seed=experts)
    w = layer(state, moe_config(experts, top_k, 64))
    assert isinstance(w.gate_up, Fp8Experts) and isinstance(w.down, Fp8Experts)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(triton_moe(x, w), torch_moe(x, w), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("world", [2, 4])
def test_fused_moe_w8a8_expert_parallel_parts_sum_to_the_layer(world: int) -> None:
    state = fp8_state(8, 64, 32, seed=3)
    moe = moe_config(8, 3, 32)
    whole = layer(state, moe)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(3))
    n = 8 // world
    parts = [layer(state, moe, experts=slice(r * n, (r + 1) * n)) for r in range(world)]
    for part, sliced in zip(parts, split_experts(whole, world)):
        assert torch.equal(part.gate_up.weight.view(torch.uint8), sliced.gate_up.weight.view(torch.uint8))
    got = [triton_moe(x, part) for part in parts]
    for part, out in zip(parts, got):
        torch.testing.assert_close(out, torch_moe(x, part), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(got).sum(0), torch_moe(x, whole), rtol=1e-5, atol=1e-5)


@interpreted
def test_fused_moe_runs_a_dequantized_down_beside_fp8_gate_up() -> None:
    """A tensor-parallel shard of 16 (world 4): gate_up kept fp8, down dequantized; each kernel
    takes its own path."""
    state = fp8_state(4, 64, 64, seed=5)
    w = layer(state, moe_config(4, 2, 64), slice(16, 32))
    assert isinstance(w.gate_up, Fp8Experts) and isinstance(w.down, torch.Tensor)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(triton_moe(x, w), torch_moe(x, w), rtol=1e-5, atol=1e-5)


# Compiles both MoE kernels' W8A8 variants for one capability; run in a child without TRITON_INTERPRET.
COMPILE = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chip_child.models import moe_kernels as k
from chip_child.models.moe_triton import BLOCK_M, BLOCK_N

target = GPUTarget("cuda", int(sys.argv[1]), 32)
consts = dict(BLOCK_M=BLOCK_M, BLOCK_K=128, GROUP_N=128, W8A8=True)
ptrs = ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32"]  # activations, their scales, weights, their scales
sizes = ["*i64", "*i32"] + ["i32"] * 4  # sorted pairs, block experts, pairs, experts, hidden, inter
strides = ["i32"] * 9  # a's row, a's scales (2), w (3), w's scales (3)
up = ptrs + ["*fp8e4nv", "*fp32"] + sizes + ["i32"] + strides + ["i32"] * 3  # act + its scales, top_k, act strides
down = ptrs + ["*bf16", "*bf16"] + sizes + strides + ["i32"]  # out, routing weights, out's stride
for name, kernel, sig, extra in (
        ("gate_up", k.gate_up_kernel, up, dict(QUANT_OUT=True, DOT_FP32=False, COMPUTE=tl.bfloat16)),
        ("down", k.down_kernel, down, dict(DOT_FP32=False))):
    # the tiles triton_moe launches: gate_up's columns one activation group of 128, down's BLOCK_N
    c = dict(consts, BLOCK_N=128 if name == "gate_up" else BLOCK_N) | extra
    signature = dict(zip(kernel.arg_names, sig + ["constexpr"] * len(c), strict=True))
    compiled = triton.compile(ASTSource(kernel, constexprs=c, signature=signature), target=target)
    print(name, "cubin", "cubin" in compiled.asm)
"""


@pytest.mark.parametrize("capability", [89, 90])
def test_w8a8_moe_kernels_compile_for_fp8_gpus(capability: int) -> None:
    """Both MoE kernels' W8A8 variants (gate_up quantizing its output for down) compiled ahead of time
    for sm_89 and sm_90 with 128 x 128 blocks (no GPU needed: Triton's own ptxas)."""
    assert compiles_in_child(COMPILE, capability) == ["gate_up cubin True", "down cubin True"]


@interpreted
def test_runtime_on_kept_fp8_experts_runs_the_fused_w8a8_moe(make_checkpoint, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-FP8 Qwen3-MoE runtime with fp8 kept (as on cuda; here interpreted) and the fused
    kernels: its experts are Fp8Experts, and its tokens and fp32 logits those of the torch reference
    of the same math (torch_moe on the same experts, fused_kernels=False)."""
    from chip_child.config import RuntimeConfig
    from chip_child.local import LocalDriver, LocalRequest
    from chip_child.step.runtime import ChipRuntime

    src = make_checkpoint("fp8-moe", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True)
    fp8_dir, _ = write_fp8_pair(src, tmp_path, BLOCK)
    monkeypatch.setattr("chip_child.step.runtime.keeps_fp8_on", lambda device, quant: True)
    results = {}
    for fused in (True, False):
        rt = ChipRuntime(RuntimeConfig(str(fp8_dir), device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64,
                                       page_size=8, fused_kernels=fused, cpu_prepack=False, decode_graphs=False))
        assert rt.ops.moe is (triton_moe if fused else torch_moe)
        assert all(isinstance(lw.moe.down, Fp8Experts) for lw in rt.weights.layers)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 10)]
        results[fused] = LocalDriver(rt).run([LocalRequest(p, 4) for p in prompts], keep_logits=True)
    assert results[True].token_ids == results[False].token_ids
    for mine, want in zip(results[True].logits, results[False].logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(want), rtol=1e-4, atol=1e-4)
