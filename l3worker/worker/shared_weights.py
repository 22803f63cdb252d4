"""Named tensors handed to chip-children through shared memory: each bucket a safetensors file in
/dev/shm (named by the writing process), written, read by the children in place (memory-mapped),
then removed. The writer is the process that holds the tensors: the offline worker itself, or an
API server's CoreClient for an engine core in another process. Never pickled, never over HTTP."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from chip_child.models.loader import ModelConfig, expected_tensor_shapes

BUCKET_BYTES = 256 << 20  # the most tensor bytes in shared memory at once
_FLOAT_STORAGE = ("F32", "BF16", "F16", "F64")


def check_tensors(entries: list[tuple[str, object, bool]], current: ModelConfig) -> None:
    """(name, shape, is floating point) of each tensor against the running model; ValueError or
    TypeError naming the first tensor it cannot take."""
    expected = expected_tensor_shapes(current)
    seen: set[str] = set()
    for name, shape, floating in entries:
        if name not in expected:
            raise ValueError(f"named_tensors: the running model has no tensor {name!r}")
        if tuple(shape) != expected[name]:
            raise ValueError(f"named_tensors: {name!r} has shape {list(shape)}, the running model's is "
                             f"{list(expected[name])}")
        if not floating:
            raise ValueError(f"named_tensors: {name!r} is not floating point; weights are")
        if name in seen:
            raise ValueError(f"named_tensors: {name!r} is given twice")
        seen.add(name)


def named_items(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a mapping or an iterable of pairs; TypeError naming a non-tensor."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"named_tensors: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return items


def header_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor stored in the safetensors files of `folder`: (shape, is floating point), from
    the headers alone."""
    found: dict[str, tuple[tuple[int, ...], bool]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                info = f.get_slice(name)
                found[name] = (tuple(info.get_shape()), info.get_dtype() in _FLOAT_STORAGE)
    return found


def header_entries(folder: str, names: list[str]) -> list[tuple[str, tuple[int, ...], bool]]:
    """check_tensors' entries for `names` in the bucket at `folder`, from its header alone."""
    stored = header_shapes(folder)
    missing = [n for n in names if n not in stored]
    if missing:
        raise ValueError(f"names: {missing} are not in the safetensors of {folder}")
    return [(n, *stored[n]) for n in names]


def shared_buckets(items: list[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES
                   ) -> Iterator[tuple[str, list[str], bool]]:
    """Writes the tensors `limit` bytes at a time, yielding (folder, names, whether it is the last
    bucket) for each; the folder is removed when the consumer asks for the next one (or stops)."""
    split = list(_split(items, limit))
    for i, bucket in enumerate(split):
        folder = tempfile.mkdtemp(prefix=f"l3worker-weights-{os.getpid()}-",
                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, os.path.join(folder, "model.safetensors"))
            yield folder, [n for n, _ in bucket], i == len(split) - 1
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _split(items: list[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
