"""A chip-child's spec handed over a socket pair, for a child started before its spec was known
(l3worker/worker/early_child.py): one byte carrying the shared buffers' descriptors (SCM_RIGHTS),
then the spec's JSON with the parent's numbers of those descriptors, then the pair closes. No torch
here: the child reads this module while its torch import is still ahead of it."""
from __future__ import annotations

import json
import os
import socket

EARLY_FLAG = "--spec-on-stdin"  # `python -m chip_child --spec-on-stdin`: the spec comes on fd 0
MAX_FDS = 64


def send_spec(sock: socket.socket, spec_json: str, fds: list[int]) -> None:
    socket.send_fds(sock, [b"\0"], fds)
    sock.sendall(json.dumps({"spec": json.loads(spec_json), "sent": fds}).encode())


def receive_spec(sock: socket.socket) -> str | None:
    """The spec's JSON with each descriptor renumbered to the one that arrived (numbers differ
    between the processes), or None when the pair closed with no spec."""
    _, fds, _, _ = socket.recv_fds(sock, 1, MAX_FDS)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    if not chunks:
        for fd in fds:
            os.close(fd)
        return None
    message = json.loads(b"".join(chunks))
    new = dict(zip(message["sent"], fds))
    spec = message["spec"]
    spec["buffers"] = {name: [new[fd], *rest] for name, (fd, *rest) in spec["buffers"].items()}
    if spec.get("wake_fd") is not None:
        spec["wake_fd"] = new[spec["wake_fd"]]
    return json.dumps(spec)
