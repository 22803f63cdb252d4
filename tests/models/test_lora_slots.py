"""The chip-child's adapter slots (chip_child.models.lora): each token's delta, grouped (eager
steps) or masked (decode graphs), equals x @ A^T @ B^T (scaled) of its own adapter, zero for the
base; whether the groups are even or padded, the slots contiguous or not, under tensor parallel
shards that sum to the whole."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from chip_child.models.loader import load_config
from chip_child.models.lora import FUSED, LoraSlots



def write(path, slots: LoraSlots, rank: int, seed: int) -> dict:
    """An adapter file in l3worker.lora.peft_adapter's layout (every part of layer 0), and its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for part, (d_in, d_out) in slots.dims.items():
        tensors[f"layers.0.{part}.A"] = torch.randn(rank, d_in, generator=g)
        tensors[f"layers.0.{part}.B"] = torch.randn(d_out, rank, generator=g) * 0.1
    save_file(tensors, str(path))
    return tensors


def reference(tensors: dict, x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.cat([x @ tensors[f"layers.0.{p}.A"].t() @ tensors[f"layers.0.{p}.B"].t() for p in FUSED[name]], -1)


@pytest.mark.parametrize("token_slots", [[0, 1, 0, 1], [2, -1, 2, 0, 0, 0, -1], [1, 1, -1], [-1, -1]],
                         ids=["even", "padded", "one-slot-not-first", "base-only"])
def test_grouped_and_masked_deltas_are_each_tokens_own_adapter(make_checkpoint, tmp_path, token_slots) -> None:
    cfg = load_config(str(make_checkpoint()))
    slots = LoraSlots(cfg, 3, 8, torch.float32, torch.device("cpu"))
    adapters = [write(tmp_path / f"{s}.safetensors", slots, rank, seed=s) for s, rank in enumerate((8, 3, 5))]
    for s in range(3):
        slots.load(s, str(tmp_path / f"{s}.safetensors"))
    ids = np.array(token_slots, np.int64)
    grouped = slots.grouped_step(ids, torch.device("cpu"))
    masked = slots.step(torch.from_numpy(ids))
    assert (grouped is None) == (ids < 0).all()
    for name in FUSED:
        x = torch.randn(len(ids), slots.a[0][name].shape[1])
        want = torch.stack([reference(adapters[s], x[t:t + 1], name)[0] if s >= 0 else
                            torch.zeros(slots.b[0][name].shape[2]) for t, s in enumerate(ids)])
        got_masked = masked.add(torch.zeros_like(want), x, 0, name)
        torch.testing.assert_close(got_masked, want, rtol=1e-5, atol=1e-5)
        if grouped is not None:
            torch.testing.assert_close(grouped.add(torch.zeros_like(want), x, 0, name), want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_shards_sum_to_the_whole(make_checkpoint, tmp_path) -> None:
    """Column-parallel parts (q/k/v, gate/up): each rank's outputs are its slice of the whole;
    row-parallel (o, down): the ranks' partial deltas over their input slices sum to the whole."""
    cfg = load_config(str(make_checkpoint()))
    whole = LoraSlots(cfg, 1, 4, torch.float32, torch.device("cpu"))
    ranks = [LoraSlots(cfg, 1, 4, torch.float32, torch.device("cpu"), rank=r, world=2) for r in range(2)]
    write(tmp_path / "a.safetensors", whole, 4, seed=7)
    for s in (whole, *ranks):
        s.load(0, str(tmp_path / "a.safetensors"))
    ids = np.zeros(3, np.int64)
    for name in ("o_proj", "down"):
        x = torch.randn(3, whole.a[0][name].shape[1])
        want = whole.grouped_step(ids, torch.device("cpu")).add(torch.zeros(3, whole.b[0][name].shape[2]), x, 0, name)
        halves = x.chunk(2, dim=1)
        got = sum(r.grouped_step(ids, torch.device("cpu")).add(torch.zeros_like(want), h, 0, name)
                  for r, h in zip(ranks, halves))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, whole.a[0]["qkv"].shape[1])
    want = whole.grouped_step(ids, torch.device("cpu")).add(torch.zeros(3, whole.b[0]["qkv"].shape[2]), x, 0, "qkv")
    q, k, v = want.split([whole.dims[p][1] for p in "qkv"], -1)
    for r, part in enumerate(ranks):
        got = part.grouped_step(ids, torch.device("cpu")).add(torch.zeros(3, part.b[0]["qkv"].shape[2]), x, 0, "qkv")
        pieces = [t.chunk(2, -1)[r] for t in (q, k, v)]
        torch.testing.assert_close(got, torch.cat(pieces, -1), rtol=1e-5, atol=1e-5)
