"""A checkpoint's fingerprint: what other nodes compare before they join the head's model.

One digest per item: config.json (its parsed contents, so key order does not matter), then each
tensor by name, over its dtype, shape and 16 windows of its bytes spread over its data (reading
every byte of a large checkpoint would cost seconds per start; two trainings or fine-tunes of one
shape differ in every window). `mismatch` names the first item that differs."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

WINDOWS, WINDOW_BYTES = 16, 64


def checkpoint_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """{"config.json": digest, tensor name: digest, ...} of the checkpoint in `model_dir`."""
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    digests = {"config.json": _digest(json.dumps(config, sort_keys=True).encode())}
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            data_start = 8 + header_len
            for name in sorted(k for k in header if k != "__metadata__"):
                entry = header[name]
                begin, end = entry["data_offsets"]
                h = hashlib.sha256(f"{entry['dtype']}{entry['shape']}".encode())
                size = end - begin
                if size <= WINDOWS * WINDOW_BYTES:
                    f.seek(data_start + begin)
                    h.update(f.read(size))
                else:
                    for i in range(WINDOWS):  # the first window at the start, the last at the end
                        f.seek(data_start + begin + (size - WINDOW_BYTES) * i // (WINDOWS - 1))
                        h.update(f.read(WINDOW_BYTES))
                digests[name] = h.hexdigest()[:16]
    return digests


def mismatch(ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first item that differs between two fingerprints, named; None when they agree."""
    for name in sorted(ours.keys() | theirs.keys()):
        if name not in ours:
            return f"tensor {name} is missing here"
        if name not in theirs:
            return f"tensor {name} is missing on the other side"
        if ours[name] != theirs[name]:
            return f"{name} differs" if name == "config.json" else f"tensor {name} differs (dtype, shape or values)"
    return None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
