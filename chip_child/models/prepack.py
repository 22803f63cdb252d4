"""CPU linear layers with their weights reordered once at load: bf16 on our AVX-512 BF16 kernel, or
our AVX2 one on a cpu without AVX-512 BF16, where it builds and passes its check
(chip_child.cpu_kernels.bf16_linear), else on oneDNN.

For a few rows (a decode step, the k + 1 tokens of a verification) MKL's sgemm repacks the
weight matrix on every call, so 16 rows cost several times one although both read the same
weights. oneDNN's inner-product primitive, given a weight already in its blocked layout, packs
nothing per call: this is the op torch's own CPU inference freezing (inductor's mkldnn fusion)
emits, `mkldnn._reorder_linear_weight` once and `mkldnn._linear_pointwise` per call. It works for
any row count with one packed copy (no per-bucket graphs or recompiles, unlike torch.compile), so
prefill chunks take it too. The packed copy replaces the plain one, except for a tied lm_head,
whose plain matrix the embedding still reads. A oneDNN call costs about 12 us more than MKL's
(measured here, one thread), more than packing saves on a small matrix: those stay on torch.mm.

Our kernel reads a bf16 weight at 1 row about 1.4x as fast as oneDNN's and, without AMX, computes at
least as fast from 16 rows up. Where the cpu has AMX, a matrix whose K is a multiple of 32 runs on
our AMX kernel instead (chip_child.cpu_kernels.bf16_amx) at every row count, from the same packed
copy: one kernel per matrix, so its bits never depend on the batch. On a cpu without AVX-512 BF16
our AVX2 kernel reads the same packed layout; oneDNN has no bf16 there, so without it (or with
`L3WORKER_REFERENCE_KERNELS=cpu_bf16_linear`) bf16 runs on torch.mm. float32 always runs on oneDNN.

`cpu_prepack=None` in RuntimeConfig turns it on for the cpu where oneDNN supports the dtype;
True elsewhere is a ValueError naming the field; False keeps torch.mm (the benchmark baseline).
"""
from __future__ import annotations

import ctypes

import torch

from chip_child.cpu_kernels import bf16_amx, bf16_linear
from chip_child.cpu_kernels.build import AVX2_FMA, missing_cpu_flags
from chip_child.device import check_optional_bool

# Weight elements below which a matrix stays plain: at 256 x 256 torch.mm is faster at 1 to 16
# rows; from 512 x 256 up the packed op is as fast at 16 rows and 2-3x faster at 5 and at 64.
MIN_PACKED_ELEMENTS = 1 << 17


def _dtype_supported(dtype: torch.dtype) -> bool:
    """What oneDNN can run here without trying an op (an op in the parent would start its thread pool)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    return probe is not None and bool(getattr(torch.ops.mkldnn, probe)())


def resolve_cpu_prepack(setting: bool | None, device_type: str, dtype: torch.dtype) -> bool:
    """Whether the cpu path's linear layers are prepacked; ValueError naming `cpu_prepack` where
    they cannot be."""
    check_optional_bool("cpu_prepack", setting)
    mkldnn = torch.backends.mkldnn.is_available()
    # Our bf16 kernels need AVX2 at least (AVX-512 BF16 implies it); whether they build and pass
    # their check is decided in the chip-child, torch.mm being the fallback there.
    ours = dtype == torch.bfloat16 and missing_cpu_flags(AVX2_FMA) is None
    runnable = device_type == "cpu" and (_dtype_supported(dtype) or ours)
    if setting is None:
        return runnable
    if setting and not runnable:
        why = (f"it is for the cpu device, got {device_type}" if device_type != "cpu" else
               "this torch is built without oneDNN (mkldnn)" if not mkldnn else
               f"oneDNN does not support {dtype} on this cpu")
        raise ValueError(f"cpu_prepack=True cannot be used: {why}")
    return setting


def _our_kernel(dtype: torch.dtype) -> tuple[str, ctypes.CDLL] | None:
    """(its name, our bf16 kernel's library) where one packs `dtype`'s matrices; None: oneDNN does."""
    return bf16_linear.best_kernel() if dtype == torch.bfloat16 else None


def _amx_kernel(dtype: torch.dtype) -> ctypes.CDLL | None:
    """Our AMX kernel's library, where our AVX-512 kernel runs too and the cpu has AMX; else None."""
    ours = _our_kernel(dtype)
    return bf16_amx.KERNEL.library() if ours is not None and ours[0] == "avx512_bf16" else None


def cpu_linear_kernel(prepack: bool, dtype: torch.dtype) -> str | None:
    """What runs the packed projections: "amx_bf16" (ours on AMX, the matrices whose K fits; the
    others on ours on AVX-512), "avx512_bf16" or "avx2_bf16" (ours), "onednn", or None (torch.mm)."""
    if not prepack:
        return None
    if _amx_kernel(dtype) is not None:
        return "amx_bf16"
    ours = _our_kernel(dtype)
    return ours[0] if ours is not None else "onednn" if _dtype_supported(dtype) else None


def prepacked(weight_t: torch.Tensor) -> "torch.Tensor | PackedLinear":
    """The [in, out] weight view prepacked; on oneDNN, as it is when smaller than
    MIN_PACKED_ELEMENTS. Our bf16 kernel packs every size: its call costs about 6 us against
    torch.mm's 20 (bf16, one row, 256 x 256, measured here)."""
    if _our_kernel(weight_t.dtype) is not None:
        return PackedLinear(weight_t)
    onednn = _dtype_supported(weight_t.dtype) and weight_t.numel() >= MIN_PACKED_ELEMENTS
    return PackedLinear(weight_t) if onednn else weight_t


class PackedLinear:
    """y = x @ W^T (+ bias) with W [out, in] packed once here: for our bf16 kernels where they run
    (`kernel` "amx_bf16", "avx512_bf16" or "avx2_bf16"), else in oneDNN's blocked layout (`kernel` "onednn").
    Called like model.linear's weight: `packed(x, bias)`."""

    __slots__ = ("weight", "out_features", "in_features", "_op", "_lib", "_name", "_amx")

    def __init__(self, weight_t: torch.Tensor):
        """`weight_t`: the [in, out] view model.LayerWeights keeps (a transposed [out, in] matrix)."""
        self.in_features, self.out_features = weight_t.shape
        ours = _our_kernel(weight_t.dtype)
        self._name, self._lib = ours if ours is not None else ("onednn", None)
        amx = _amx_kernel(weight_t.dtype)
        self._amx = amx if amx is not None and bf16_amx.fits(self.in_features) else None
        if self._lib is not None:
            self.weight = bf16_linear.pack(self._lib, weight_t.t())
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), None)
        # The overload itself: calling the op's packet would match its schemas on every call.
        self._op = torch.ops.mkldnn._linear_pointwise.default

    @property
    def kernel(self) -> str:
        if self._amx is not None:
            return "amx_bf16"
        return self._name

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._amx is not None:
            return bf16_amx.linear(self._amx, x, self.weight, self.out_features, bias)
        if self._lib is not None:
            return bf16_linear.linear(self._lib, x, self.weight, self.out_features, bias)
        return self._op(x, self.weight, bias, "none", [], "")

    def __repr__(self) -> str:
        return f"PackedLinear({self.in_features} -> {self.out_features}, {self.weight.dtype}, {self.kernel})"
