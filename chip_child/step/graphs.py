"""Decode lanes and decode graphs.

A decode step runs lanes [0, n) only, n being the lane bucket of the step's highest active row
(the scheduler hands out rows lowest index first, so the busy rows sit at the bottom). Buckets
are the powers of two below max_batch_size, and max_batch_size itself.

On cuda and npu the decode-only step's forward (slots, lengths, embedding through logits) is
captured once per bucket at warm-up and replayed each step. A captured step holds host values
fixed: the lane count, max_seq_len (the config's, so the block table is read at its full width)
and no host copy of the lengths. Everything that varies per step (input ids, positions, slots,
block-table contents, lengths) is read from pooled tensors, whose addresses never change, so a
replay needs no copy: the previous step and the command already left the inputs in place.

The cuda capture (torch.cuda.CUDAGraph) has run on an H100 (tests/gpu/test_cuda.py: tokens and fp32
logits equal transformers' through replayed graphs). The npu capture (torch.npu.NPUGraph) has not
run on an NPU. The cpu tests check the property both rely on (a forward made with the bucket's
bounds gives the exact forward's logits) and the capture/replay driving with a stand-in capturer.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from chip_child.device import check_optional_bool

Replay = Callable[[], None]
GRAPH_DEVICES = ("cuda", "npu")


def lane_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The lane counts a step may run: powers of two below max_batch_size, then max_batch_size."""
    buckets, n = [], 1
    while n < max_batch_size:
        buckets.append(n)
        n *= 2
    return (*buckets, max_batch_size)


def bucket_of(max_batch_size: int) -> np.ndarray:
    """[max_batch_size + 1]: entry k is the smallest bucket holding lanes [0, k) (at least one
    lane, so a step without active rows still has a well-formed decode axis)."""
    buckets = lane_buckets(max_batch_size)
    return np.array([next(b for b in buckets if b >= max(k, 1)) for k in range(max_batch_size + 1)], np.int64)


def resolve_decode_graphs(setting: bool | None, device_type: str, backend_capturable: bool,
                          backend_name: str, model_capturable: bool = True) -> bool:
    """Whether decode graphs are used: None turns them on for cuda and npu where the attention
    backend's decode plan and the model (`model_capturable`: not a MoE, whose torch experts read
    per-expert counts on the host) can be captured; True insists (ValueError where it cannot work)."""
    check_optional_bool("decode_graphs", setting)
    if setting is None:
        return device_type in GRAPH_DEVICES and backend_capturable and model_capturable
    if setting and device_type not in GRAPH_DEVICES:
        raise ValueError(f"decode_graphs=True needs a cuda or npu device, got {device_type}: "
                         "leave it None (off on cpu) or pass False")
    if setting and not backend_capturable:
        raise ValueError(f"decode_graphs=True cannot be used with attention_backend={backend_name!r}: its decode "
                         "plan hands host copies of the lengths to the device, which a graph would freeze")
    if setting and not model_capturable:
        raise ValueError("decode_graphs=True cannot be used with a MoE model: its torch experts read the "
                         "per-expert token counts on the host, which a graph would freeze")
    return setting


class Capturer(Protocol):
    """Turns a callable into a replay of what it did on the device."""

    def capture(self, fn: Callable[[], None]) -> Replay: ...


class DeviceGraphs:
    """Captures into torch.cuda.CUDAGraph or torch.npu.NPUGraph; every graph shares one memory
    pool, so capture the largest bucket first and the smaller ones reuse its intermediates."""

    def __init__(self, device: torch.device):
        if device.type not in GRAPH_DEVICES:
            raise ValueError(f"decode graphs need a cuda or npu device, got {device}")
        self._api = getattr(torch, device.type)  # torch.cuda, or torch.npu once torch_npu is imported
        self._graph_cls = self._api.CUDAGraph if device.type == "cuda" else self._api.NPUGraph
        self._pool = self._api.graph_pool_handle()
        self._stream = self._api.Stream(device)

    def capture(self, fn: Callable[[], None]) -> Replay:
        # One eager run on the capture stream first: lazy initialisation (library handles,
        # kernel compilation) must not happen inside the capture.
        self._stream.wait_stream(self._api.current_stream())
        with self._api.stream(self._stream):
            fn()
        self._api.current_stream().wait_stream(self._stream)
        graph = self._graph_cls()
        with self._api.graph(graph, pool=self._pool, stream=self._stream):
            fn()
        self._api.synchronize()
        return graph.replay


class DecodeGraphs:
    """One replay per lane bucket: `capture(lanes, fn)` at warm-up, `replay(lanes)` per step."""

    def __init__(self, capturer: Capturer):
        self._capturer = capturer
        self._replays: dict[int, Replay] = {}

    def capture(self, lanes: int, fn: Callable[[], None]) -> None:
        self._replays[lanes] = self._capturer.capture(fn)

    def fresh(self) -> "DecodeGraphs":
        """No graphs yet, with the same capturer (and memory pool): to capture again."""
        return DecodeGraphs(self._capturer)

    def replay(self, lanes: int) -> None:
        self._replays[lanes]()

    @property
    def lanes(self) -> tuple[int, ...]:
        return tuple(sorted(self._replays))
