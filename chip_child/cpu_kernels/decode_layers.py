"""A pure decode step's layers in one call (decode_layers.cpp): the kernels chip_child.models.qwen3.
forward calls one by one from Python on the cpu (layer_ops, the packed projections, decode
attention), called in the same order on the same buffers from C. The bits are the same; what goes
is Python's cost per layer, its ten or so calls, views and allocations: about half of a 27M
model's batch-1 step on the 2-core CI machine (docs/performance/cpu.md#one-call-per-decode-step).

`DecodeLayers.of(rt)` takes a runtime whose model it can run: bf16, every layer dense, every
projection packed for our kernels and without a bias, our layer ops and decode attention in use,
one device, no LoRA slots, no speculation. Anything else runs forward as before and says why once
on stderr. Its first step also runs forward and must give the same bits, or it is not used again
(a KernelVerdict "decode_layers" in the runtime's kernel checks either way).
`L3WORKER_REFERENCE_KERNELS=cpu_decode_layers` turns it off.

A step whose rows all take the argmax then ends in one more call, l3_decode_head: the final norm,
the lm_head on the step team, the fp32 logits and the ids, checked at load (HEAD_KERNEL) and on
its first step against final_logits and first_max (KernelVerdict "decode_head");
`L3WORKER_REFERENCE_KERNELS=cpu_decode_head` turns that off alone."""
from __future__ import annotations

import ctypes
import sys
from typing import Callable, Protocol

import torch

from chip_child.attention import AttentionBackend, StepPlan
from chip_child.config import RuntimeConfig
from chip_child.cpu_kernels import bf16_amx, bf16_linear, decode_attention, layer_ops
from chip_child.cpu_kernels.build import CheckedKernel
from chip_child.models.kernel_checks import KernelVerdict
from chip_child.models.loader import ModelConfig
from chip_child.models.prepack import PackedLinear
from chip_child.models.qwen3 import PROJECTIONS, LayerWeights, Qwen3Weights, final_logits
from chip_child.sampling.sampler import first_max

_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
LAYER_OPS = ("add_rms_norm", "qk_norm_rope", "silu_mul")  # the kernel checks these must have passed


class _Projection(ctypes.Structure):
    _fields_ = [("run", _PTR), ("packed", _PTR), ("blocks", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("qkv", _Projection), ("qk_norm", _PTR), ("o_proj", _Projection),
                ("post_norm", _PTR), ("gate_up", _Projection), ("down", _Projection), ("k_cache", _PTR),
                ("v_cache", _PTR)]


class _Model(ctypes.Structure):
    _fields_ = [("add_rms_norm", _PTR), ("qk_norm_rope", _PTR), ("silu_mul", _PTR), ("attention", _PTR),
                ("layers", ctypes.POINTER(_Layer)), ("num_layers", _I64), ("hidden", _I64), ("heads", _I64),
                ("kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64), ("head_stride", _I64),
                ("page_stride", _I64), ("page_size", _I64), ("eps", _F32), ("scale", _F32)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("rope", _PTR), ("positions", _PTR), ("pos64", _INT), ("block_table", _PTR),
                ("table_stride", _I64), ("seq_lens", _PTR), ("slots", _PTR), ("threads", _INT), ("team", _INT)]


class _Head(ctypes.Structure):
    _fields_ = [("norm", _PTR), ("lm_head", _Projection), ("vocab", _I64)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.l3_decode_layers_abi.argtypes, lib.l3_decode_layers_abi.restype = [_I64], _I64
    lib.l3_decode_layers_work.argtypes, lib.l3_decode_layers_work.restype = [ctypes.POINTER(_Model)], _I64
    lib.l3_decode_layers.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _PTR, _PTR, _PTR]
    lib.l3_decode_layers.restype = None
    lib.l3_decode_layers_team_rows.argtypes = [ctypes.POINTER(_Model)]
    lib.l3_decode_layers_team_rows.restype = _I64
    lib.l3_team_linear.argtypes = [ctypes.POINTER(_Projection), _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT]
    lib.l3_team_linear.restype = None
    lib.l3_decode_head.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Head), _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                   _PTR, _I64, _PTR, _INT]
    lib.l3_decode_head.restype = None
    lib.l3_step_team_hold.argtypes, lib.l3_step_team_hold.restype = [_INT], None
    lib.l3_step_team_helper_units.argtypes, lib.l3_step_team_helper_units.restype = [], _I64
    return lib


def check_abi(lib: ctypes.CDLL) -> float:
    """0 where the C structures are the sizes of their ctypes mirrors, else infinite: the driver
    has no arithmetic of its own to check (the model-level check is DecodeLayers' first step)."""
    sizes = [ctypes.sizeof(s) for s in (_Layer, _Model, _Step, _Head)]
    return 0.0 if [lib.l3_decode_layers_abi(i) for i in range(4)] == sizes else float("inf")


# The driver only calls the kernels it is given, so it needs no instruction set of its own: it runs
# beside the AVX-512 kernels and the AVX2 ones alike.
KERNEL = CheckedKernel("cpu_decode_layers", "decode_layers.cpp", "decode steps run layer by layer from Python",
                       _bind, check_abi, 0.0, cpu_flags=(), compile_flags=["-std=c++17", "-O2"])


def check_team(lib: ctypes.CDLL) -> float:
    """0 where a projection run on the step team gives the bits of the same kernel on one thread
    (where neither bf16 kernel is usable, the team is never used: 0)."""
    linear_lib = _linear_library()
    if linear_lib is None:
        return 0.0
    g = torch.Generator().manual_seed(0)
    n, k = 4 * 64 + 5, 96  # a partial last block
    packed = bf16_linear.pack(linear_lib, torch.randn(n, k, generator=g).to(torch.bfloat16))
    x = torch.randn(2, k, generator=g).to(torch.bfloat16)
    want, got = (torch.empty(2, n, dtype=torch.bfloat16) for _ in range(2))
    linear_lib.l3_bf16_linear(x.data_ptr(), k, packed.data_ptr(), None, want.data_ptr(), n, 2, n, k, 1)
    p = team_projection(linear_lib, packed.data_ptr())
    lib.l3_team_linear(p, x.data_ptr(), k, got.data_ptr(), n, 2, n, k, max(2, torch.get_num_threads()))
    return 0.0 if torch.equal(want, got) else float("inf")


# The step team (step_team.h) lives in the same library; this switch and check are its own, so
# `L3WORKER_REFERENCE_KERNELS=cpu_step_team` puts the stages back on OpenMP regions alone.
TEAM_KERNEL = CheckedKernel("cpu_step_team", "decode_layers.cpp", "decode steps run their stages as OpenMP regions",
                            _bind, check_team, 0.0, cpu_flags=(), compile_flags=["-std=c++17", "-O2"])


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _PTR).value


def check_head(lib: ctypes.CDLL) -> float:
    """0 where l3_decode_head on the team gives the bits of its pieces run one by one (the norm
    kernel, the projection on one thread, torch's widening and first_max): the hidden states, the
    fp32 logits and the ids, with row 0's largest logit tied in two blocks (the first is its pick)
    and then a NaN logit in every row (argmax picks it). Where no bf16 kernel or layer ops are
    usable the team, and so the head, never runs: 0."""
    linear_lib, ops_lib = _linear_library(), layer_ops.library()
    if linear_lib is None or ops_lib is None:
        return 0.0
    g = torch.Generator().manual_seed(0)
    rows, n, vocab, eps = 2, 64, 3 * 64 + 5, 1e-6  # a partial last block
    h, delta = (torch.randn(rows, n, generator=g).to(torch.bfloat16) for _ in range(2))
    norm = (1 + 0.5 * torch.randn(n, generator=g)).to(torch.bfloat16)
    want_hidden, want_x, hidden, x = (torch.empty(rows, n, dtype=torch.bfloat16) for _ in range(4))
    ops_lib.l3_add_rms_norm(h.data_ptr(), n, delta.data_ptr(), n, norm.data_ptr(), eps, want_hidden.data_ptr(), n,
                            want_x.data_ptr(), n, rows, n)
    weight = 0.01 * torch.randn(vocab, n, generator=g)
    weight[5] = weight[130] = want_x[0].float()  # x . x: row 0's largest logit, in blocks 0 and 2
    model = _Model(add_rms_norm=_address(ops_lib, "l3_add_rms_norm"), hidden=n, eps=eps)
    same = True
    for nan_at in (None, 70):
        w = weight.clone()
        if nan_at is not None:
            w[nan_at] = float("nan")
        packed = bf16_linear.pack(linear_lib, w.to(torch.bfloat16))
        y = torch.empty(rows, vocab, dtype=torch.bfloat16)
        linear_lib.l3_bf16_linear(want_x.data_ptr(), n, packed.data_ptr(), None, y.data_ptr(), vocab, rows, vocab, n, 1)
        want_logits = y.float()
        want_ids = first_max(want_logits)
        logits, ids, scratch = torch.empty(rows, vocab), torch.empty(rows, dtype=torch.int64), torch.empty_like(y)
        head = _Head(norm.data_ptr(), team_projection(linear_lib, packed.data_ptr()), vocab)
        lib.l3_decode_head(model, head, rows, h.data_ptr(), delta.data_ptr(), hidden.data_ptr(), x.data_ptr(),
                           scratch.data_ptr(), logits.data_ptr(), vocab, ids.data_ptr(),
                           max(2, torch.get_num_threads()))
        same &= (torch.equal(hidden, want_hidden) and torch.equal(ids, want_ids)
                 and torch.equal(logits.view(torch.int32), want_logits.view(torch.int32))  # NaNs too, bit for bit
                 and int(want_ids[0]) == (5 if nan_at is None else nan_at))
    return 0.0 if same else float("inf")


# The end of a greedy step in C (l3_decode_head), switched and checked on its own:
# `L3WORKER_REFERENCE_KERNELS=cpu_decode_head` puts it back on final_logits and the sampler.
HEAD_KERNEL = CheckedKernel("cpu_decode_head", "decode_layers.cpp",
                            "greedy decode steps take their final norm, lm_head and pick from Python", _bind,
                            check_head, 0.0, cpu_flags=(), compile_flags=["-std=c++17", "-O2"])


def _linear_library() -> ctypes.CDLL | None:
    """The bf16 kernel the projections run on here (AVX-512 or AVX2), or None."""
    best = bf16_linear.best_kernel()
    return None if best is None else best[1]


def team_projection(linear_lib: ctypes.CDLL, packed: int) -> _Projection:
    """A matrix packed for a bf16 kernel (`linear_lib`), with the one-thread entry the team runs."""
    return _Projection(_address(linear_lib, "l3_bf16_linear"), packed, _address(linear_lib, "l3_bf16_linear_blocks"))


class Runtime(Protocol):
    """What the one-call layers read of a chip runtime (chip_child.step.runtime.ChipRuntime, which
    holds them): the model and its caches, and the choices that rule them out."""
    cfg: RuntimeConfig
    model_cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    weights: Qwen3Weights
    rope: torch.Tensor
    attn: AttentionBackend
    ops: object  # the layer ops: .name "cpu" for the cpu kernels
    lora: object | None
    spec: object | None
    kernel_checks: list[KernelVerdict]


def _why_not(rt: Runtime) -> str | None:
    """Why the runtime's model cannot take the one-call decode layers; None: it can."""
    w, cfg = rt.weights, rt.cfg
    if cfg.tp_size > 1 or rt.lora is not None or rt.spec is not None:
        return "tensor parallelism, LoRA slots and speculation take the layer-by-layer path"
    if rt.ops.name != "cpu" or not all(v.used for v in rt.kernel_checks if v.kernel in LAYER_OPS):
        return "the cpu layer ops are not all in use"
    if not getattr(rt.attn, "uses_kernel", False) or rt.attn.decode_mirror:
        return "decode attention is not on the cpu kernel"
    mc = rt.model_cfg
    if mc.hidden_size % 16 or mc.hidden_size > 16384 or mc.head_dim % 32 or mc.head_dim > 512:
        return f"the layer ops take hidden sizes of 16n up to 16384 and head sizes of 32n up to 512, not " \
               f"{mc.hidden_size} and {mc.head_dim}"
    if not rt.rope.is_contiguous() or rt.rope.dtype != torch.bfloat16:
        return "the rope table is not contiguous bf16"
    for lw in w.layers:
        if lw.moe is not None or lw.qkv_bias is not None or lw.o_bias is not None:
            return "a layer has experts or biases"
        for name in PROJECTIONS:
            p = getattr(lw, name)
            if type(p) is not PackedLinear or p.kernel not in ("amx_bf16", "avx512_bf16", "avx2_bf16"):
                return f"a {name} projection is not packed for our bf16 kernels"
        norms = [n for n in (lw.input_norm, lw.post_norm, lw.qk_norm) if n is not None]
        if not all(n.dtype == torch.bfloat16 and n.is_contiguous() for n in norms):
            return "a norm weight is not contiguous bf16"
        if lw.qk_norm is not None and lw.qk_norm.shape != (mc.num_heads + mc.num_kv_heads, mc.head_dim):
            return f"a q/k norm weight is {tuple(lw.qk_norm.shape)}, not a row per head"
    return None


class DecodeLayers:
    """The one-call decode layers of one runtime's model; `forward` stands in for qwen3.forward on a
    pure decode step planned for the cpu attention kernel."""

    def __init__(self, lib: ctypes.CDLL, rt: Runtime, verdicts: list[KernelVerdict]):
        self.lib, self.rt, self.verdicts = lib, rt, verdicts
        self.verified = False  # until the first step has matched forward
        self.refused = False  # the first step did not match: every step runs `reference` from then on
        self._layers = self._model = None
        # Each layer's key and value caches [kv_heads, pages, page_size, head_dim]: views made once,
        # whose addresses follow their storage (sleep frees and reallocates it).
        self._caches = [tuple(rt.attn.layer_cache(i).unbind(0)) for i in range(len(rt.weights.layers))]
        self._built_for: tuple[int, ...] = ()  # the addresses the layer table holds
        # The addresses are read again only after something may have moved them: a control (sleep,
        # wake-up, new weights; RuntimeControls calls weights_moved). Reading them every step took
        # tens of microseconds of a 27M model's 1.3 ms decode step on two cores.
        self._moved = True
        self._work_per_row = 0
        self._step_buffers: dict[int, tuple[torch.Tensor, ...]] = {}  # views of _widest's, by row count
        self._widest: tuple[torch.Tensor, ...] = ()  # the buffers for the most rows a step has had
        # Steps of up to this many rows run their projections and attention on the step team
        # (step_team.h) instead of an OpenMP region each; 0: none do.
        self.team_rows = 0
        self._lm_head: _Projection | None = None  # the lm_head on the team, where it is packed for it
        # A greedy step's final norm, lm_head and pick in one C call (l3_decode_head), where the
        # lm_head runs on the team and HEAD_KERNEL passed its check; its first step is checked
        # against final_logits and first_max as well, and refused for good if they differ.
        self._head: _Head | None = None
        self.head_verified = self.head_refused = False
        # Its scratch for the most rows a step has had: the bf16 logits, and the fp32 logits and ids
        # of packed rows (idle lanes left out), written to their lanes after.
        self._head_bufs: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, rt: Runtime) -> "DecodeLayers | None":
        """None for a model it cannot run (said once on stderr) and off the bf16 cpu path (silently:
        float32 and accelerators have their own)."""
        if rt.device.type != "cpu" or rt.dtype != torch.bfloat16:
            return None
        lib = KERNEL.library()
        if lib is None:
            return None
        why = _why_not(rt)
        if why is not None:
            print(f"chip-child: decode steps run layer by layer from Python: {why}", file=sys.stderr, flush=True)
            return None
        return cls(lib, rt, rt.kernel_checks)

    def weights_moved(self) -> None:
        """Something may have moved a weight or a cache: the next step reads every address again.
        The runtime's controls call it; anything else that moves one (a test) must too."""
        self._moved = True

    def _addresses(self) -> tuple[int, ...]:
        """Every address the layer table holds, in its order."""
        out = []
        for lw, (k, v) in zip(self.rt.weights.layers, self._caches):
            qk_norm = 0 if lw.qk_norm is None else lw.qk_norm.data_ptr()
            out += (lw.input_norm.data_ptr(), lw.qkv.weight.data_ptr(), qk_norm,
                    lw.o_proj.weight.data_ptr(), lw.post_norm.data_ptr(), lw.gate_up.weight.data_ptr(),
                    lw.down.weight.data_ptr(), k.data_ptr(), v.data_ptr())
        w = self.rt.weights
        return tuple(out) + (w.norm.data_ptr(), w.lm_head.weight.data_ptr() if type(w.lm_head) is PackedLinear else 0)

    def _build(self, addresses: tuple[int, ...]) -> None:
        rt, mc = self.rt, self.rt.model_cfg
        ops_lib, attn_lib = layer_ops.library(), decode_attention.library()
        name, linear_lib = bf16_linear.best_kernel()  # what every PackedLinear here runs on
        runs = {name: _address(linear_lib, "l3_bf16_linear")}
        blocks = {name: _address(linear_lib, "l3_bf16_linear_blocks")}
        if name == "avx512_bf16" and bf16_amx.KERNEL.library() is not None:
            runs["amx_bf16"] = _address(bf16_amx.KERNEL.library(), "l3_bf16_amx_linear")
        layers = (_Layer * mc.num_layers)()
        for i, lw in enumerate(rt.weights.layers):
            lw: LayerWeights
            a = addresses[9 * i:9 * i + 9]
            p = {n: _Projection(runs[getattr(lw, n).kernel], a[j], blocks.get(getattr(lw, n).kernel))
                 for n, j in (("qkv", 1), ("o_proj", 3), ("gate_up", 5), ("down", 6))}
            layers[i] = _Layer(a[0], p["qkv"], a[2] or None, p["o_proj"], a[4], p["gate_up"], p["down"], a[7], a[8])
        k = rt.attn.layer_cache(0)[0]
        self._layers = layers  # the model points into it
        self._model = _Model(_address(ops_lib, "l3_add_rms_norm"), _address(ops_lib, "l3_qk_norm_rope"),
                             _address(ops_lib, "l3_silu_mul"), _address(attn_lib, "l3_decode_attention"), layers,
                             mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             mc.intermediate_size, k.stride(0), k.stride(1), k.shape[2], rt.weights.eps_value,
                             rt.attn.spec.softmax_scale)
        self._work_per_row = self.lib.l3_decode_layers_work(self._model)
        self._step_buffers, self._widest = {}, ()
        self._built_for = addresses
        # The team runs units on the kernels' one-thread entries (a block, a pair) alone: every
        # projection must have one (an AMX one has none), or no stage runs there.
        on_team = (TEAM_KERNEL.usable() and torch.get_num_threads() > 1 and attn_lib is not None
                   and all(getattr(lw, n).kernel in blocks for lw in rt.weights.layers for n in PROJECTIONS))
        self.team_rows = self.lib.l3_decode_layers_team_rows(self._model) if on_team else 0
        head = rt.weights.lm_head
        self._lm_head = team_projection(linear_lib, addresses[-1]) \
            if on_team and type(head) is PackedLinear and head.kernel in blocks else None
        norm = rt.weights.norm
        fits = self._lm_head is not None and head.out_features == mc.vocab_size and (  # logits fill a step's rows
            norm.dtype == torch.bfloat16 and norm.is_contiguous() and norm.shape == (mc.hidden_size,))
        self._head = _Head(addresses[-2], self._lm_head, head.out_features) if fits and HEAD_KERNEL.usable() else None

    def forward(self, step: StepPlan, tokens: torch.Tensor, positions: torch.Tensor,
                reference: Callable[[], torch.Tensor],
                greedy: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """The last layer's hidden states [rows, hidden], as qwen3.forward returns them. On the first
        step `reference` (that forward) runs first: both write the same keys and values, and the
        hidden states must be equal, or the layer-by-layer path serves from then on.
        `greedy` (logits [lanes, vocab] fp32, ids [lanes] int64, the lanes of these rows or None: the
        first rows), for a step whose rows all take the argmax: where the head runs in C, it writes
        their logits and ids and this returns None."""
        if self.refused or not step.extra.get("kernel_decode"):  # a step the cpu attention kernel does not take
            return reference()
        if self._moved:
            addresses = self._addresses()
            if addresses != self._built_for:
                self._build(addresses)
            self._moved = False
        meta, rt = step.meta, self.rt
        rows = tokens.shape[0]
        table, lens = meta.block_table, meta.seq_lens
        if (table.stride(-1) != 1 or lens.dtype != torch.int32 or not lens.is_contiguous()
                or not positions.is_contiguous()):
            return reference()
        want = None if self.verified else reference()
        h, delta, work, hidden = self._buffers(rows)
        torch.index_select(rt.weights.embed, 0, tokens, out=h)  # the embedding, into the step's own buffer
        s = _Step(rows, rt.rope.data_ptr(), positions.data_ptr(), int(positions.dtype == torch.int64),
                  table.data_ptr(), table.stride(0), lens.data_ptr(), step.extra["slots"].data_ptr(),
                  torch.get_num_threads(), int(rows <= self.team_rows))
        self.lib.l3_decode_layers(self._model, s, h.data_ptr(), delta.data_ptr(), work.data_ptr())
        if greedy is not None and self._head is not None and rows <= self.team_rows and self.verified \
                and not self.head_refused:
            self._greedy_head(h, delta, hidden, work, *greedy)
            return None
        torch.add(h, delta, out=hidden)
        if want is not None:
            error = ((hidden.float() - want.float()).abs().max() / want.float().abs().max()).item()
            self.verified = True
            if not self._verdict("decode_layers", torch.equal(hidden, want), error,
                                 "layers differ from the layer-by-layer forward on this model: decode steps run "
                                 "layer by layer from now on"):
                self.refused = True
                return want
        return hidden

    def _greedy_head(self, h: torch.Tensor, delta: torch.Tensor, hidden: torch.Tensor, work: torch.Tensor,
                     to_logits: torch.Tensor, to_ids: torch.Tensor, lanes: torch.Tensor | None) -> None:
        """l3_decode_head into the rows' lanes of `to_logits` and `to_ids` (through buffers of their
        own where the rows are packed). Its first step also runs final_logits and first_max (the
        team's lm_head, as `logits` runs it) and must give the same bits, or those serve from then on."""
        rows, vocab = h.shape[0], self._head.vocab
        if not self._head_bufs or self._head_bufs[0].shape[0] < rows:
            self._head_bufs = (torch.empty(rows, vocab, dtype=torch.bfloat16), torch.empty(rows, vocab),
                               torch.empty(rows, dtype=torch.int64))
        y, packed_logits, packed_ids = self._head_bufs
        logits, ids = (to_logits, to_ids) if lanes is None else (packed_logits[:rows], packed_ids[:rows])
        if logits.stride() != (vocab, 1) or ids.dtype != torch.int64 or not ids.is_contiguous():
            raise ValueError(f"the greedy head writes contiguous fp32 logits [rows, {vocab}] and int64 ids")
        self.lib.l3_decode_head(self._model, self._head, rows, h.data_ptr(), delta.data_ptr(), hidden.data_ptr(),
                                work.data_ptr(), y.data_ptr(), logits.data_ptr(), vocab, ids.data_ptr(),
                                torch.get_num_threads())
        if not self.head_verified:
            self._verify_head(h + delta, logits, ids)
        if lanes is not None:
            to_logits.index_copy_(0, lanes, logits)
            to_ids.index_copy_(0, lanes, ids)

    def _verify_head(self, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> None:
        want_logits = final_logits(self.rt.weights, hidden, None, self.rt.ops, self._team_lm_head)
        want_ids = first_max(want_logits)
        same = (torch.equal(logits.view(torch.int32), want_logits.view(torch.int32)) and torch.equal(ids, want_ids))
        error = ((logits - want_logits).abs().max() / want_logits.abs().max().clamp_min(1e-30)).item()
        self.head_verified = True
        if not self._verdict("decode_head", same, error, "head differs from final_logits and the sampler's "
                             "argmax on this model: greedy steps take them from Python from now on"):
            self.head_refused = True
            logits.copy_(want_logits)
            ids.copy_(want_ids)

    def _verdict(self, kernel: str, same: bool, error: float, differs: str) -> bool:
        """Records a first step's check in the runtime's kernel checks; where it failed, says on
        stderr what serves from then on."""
        self.verdicts.append(KernelVerdict(kernel, error, same))
        if not same:
            print(f"chip-child: the one-call decode {differs}", file=sys.stderr, flush=True)
        return same

    def _buffers(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The embedded tokens, the last layer's delta, the kernels' scratch and the hidden states for
        a step of `rows` rows: the first rows of one set sized for the most rows a step has had, so
        the memory is one step's at the widest (the hidden states are read before the next step)."""
        bufs = self._step_buffers.get(rows)
        if bufs is None:
            if not self._widest or self._widest[0].shape[0] < rows:
                n = self.rt.model_cfg.hidden_size
                self._widest = (*(torch.empty(rows, n, dtype=torch.bfloat16) for _ in range(2)),
                                torch.empty(rows * self._work_per_row, dtype=torch.bfloat16),
                                torch.empty(rows, n, dtype=torch.bfloat16))
                self._step_buffers = {}  # views of the smaller set
            h, delta, work, hidden = self._widest
            bufs = self._step_buffers[rows] = (h[:rows], delta[:rows], work[:rows * self._work_per_row], hidden[:rows])
        return bufs

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """qwen3.final_logits of the last layer's hidden states (into `out` when given), its lm_head
        on the step team for a step of up to team_rows rows: the same kernel on the same blocks, so
        the same bits."""
        rt = self.rt
        team = self._lm_head is not None and hidden.shape[0] <= self.team_rows and self.verified and not self.refused
        return final_logits(rt.weights, hidden, out, rt.ops, self._team_lm_head if team else None)

    def _team_lm_head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.rt.weights.lm_head
        y = torch.empty(x.shape[0], head.out_features, dtype=torch.bfloat16)
        self.lib.l3_team_linear(self._lm_head, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0],
                                head.out_features, head.in_features, torch.get_num_threads())
        return y
