"""A backend other than the torch reference checks itself once, on the device it is about to run
on, at the model's heads, head size, page size and dtype: two steps over a shuffled paged cache
(prompt chunks, then a decode row beside a chunk with context), against TorchAttention on the
same inputs. One that disagrees is replaced by the reference, named on stderr.
`L3WORKER_REFERENCE_KERNELS=attention` forces the reference without a check."""
from __future__ import annotations

import sys
from dataclasses import replace

import torch

from chip_child.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from chip_child.attention.torch_backend import TorchAttention
from chip_child.kernel_choice import forced_reference

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# (query length, sequence length) per sequence of each step: a chunk from position 0, a longer
# prompt's first chunk; then a decode row and that prompt's next chunk, each over its cache; then
# a pure decode step (a path of its own in some backends).
STEPS = (((5, 5), (9, 9)), ((1, 6), (7, 16)), ((1, 7), (1, 17)))


def checked_backend(backend: type[AttentionBackend], spec: AttentionSpec,
                    device: torch.device) -> tuple[type[AttentionBackend], tuple[float | None, bool] | None]:
    """The backend to run (`backend`, or TorchAttention when it fails its check or is forced off)
    and the check's report: (relative error, None when forced; whether `backend` runs), None when
    `backend` is the reference itself."""
    if backend is TorchAttention:
        return backend, None
    if "attention" in forced_reference():
        return TorchAttention, (None, False)
    error = attention_error(backend, spec, device)
    if error > TOLERANCE.get(spec.dtype, 5e-2):
        print(f"chip-child: the {backend.name} attention backend failed its self-check on {device} (relative "
              f"error {error:.3g}): the torch backend runs instead", file=sys.stderr, flush=True)
        return TorchAttention, (error, False)
    return backend, (error, True)


def attention_error(backend: type[AttentionBackend], spec: AttentionSpec, device: torch.device) -> float:
    page = spec.page_size
    pages_per_seq = -(-max(s for step in STEPS for _, s in step) // page)
    small = replace(spec, num_layers=1, num_pages=2 * pages_per_seq + 2, max_tokens=32, max_seqs=4,
                    max_blocks=pages_per_seq)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(2 * pages_per_seq, generator=gen) + 1  # shuffled pages, never page 0
    table = order.view(2, pages_per_seq).to(torch.int32)
    candidate, reference = backend(small, device).allocate(), TorchAttention(small, device).allocate()
    worst = 0.0
    for step in STEPS:
        q_lens, s_lens = [q for q, _ in step], [s for _, s in step]
        meta = AttentionMetadata.from_lengths(q_lens, s_lens, table, page, device=device)
        tokens = sum(q_lens)

        def rand(heads: int) -> torch.Tensor:
            x = torch.randn(tokens, heads, spec.head_dim, generator=gen)
            return x.to(device=device, dtype=spec.dtype)

        q, k, v = rand(spec.num_heads), rand(spec.num_kv_heads), rand(spec.num_kv_heads)
        got = candidate.forward(0, q, k, v, candidate.plan(meta)).float()
        want = reference.forward(0, q, k, v, reference.plan(meta)).float()
        if got.shape != want.shape or not torch.isfinite(got).all():
            return float("inf")
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
    return worst
