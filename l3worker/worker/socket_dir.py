"""Directories for ipc:// sockets. A Unix socket's path holds at most 107 bytes, so under a long
TMPDIR (macOS's /var/folders/..., a test's private directory) the directory goes to /tmp instead."""
from __future__ import annotations

import tempfile

import zmq

# The longest socket file name written into such a directory, with its slash: "/chip15-99999.sock"
# (rank, restart generation), beside "/core-7" and "/out-7".
_NAME_ROOM = 20
_RANDOM_SUFFIX = 8  # what mkdtemp appends to the prefix


def make_socket_dir(prefix: str) -> str:
    """A fresh private directory whose sockets' paths fit a Unix socket address."""
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107
    base = tempfile.gettempdir()
    if len(base) + 1 + len(prefix) + _RANDOM_SUFFIX + _NAME_ROOM > limit:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)
