"""A chip-child's spec handed over a socket pair, for a child started before its spec was known
(l3worker/worker/early_child.py): one byte carrying the spec's descriptors (SCM_RIGHTS), then the
spec's JSON, which names them by the parent's numbers, then the pair closes. No torch here: the
child reads this module while its torch import is still ahead of it."""
from __future__ import annotations

import os
import socket

from chip_child.child_spec import ChildSpec

EARLY_FLAG = "--spec-on-stdin"  # `python -m chip_child --spec-on-stdin`: the spec comes on fd 0
MAX_FDS = 64


def send_spec(sock: socket.socket, spec: ChildSpec) -> None:
    socket.send_fds(sock, [b"\0"], spec.fds)
    sock.sendall(spec.to_json().encode())


def receive_spec(sock: socket.socket) -> ChildSpec | None:
    """The spec with its descriptors renumbered to the ones that arrived (numbers differ between
    the processes), or None when the pair closed with no spec."""
    _, fds, _, _ = socket.recv_fds(sock, 1, MAX_FDS)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    if not chunks:
        for fd in fds:
            os.close(fd)
        return None
    spec = ChildSpec.from_json(b"".join(chunks).decode())
    return spec.renumbered(dict(zip(spec.fds, fds)))
