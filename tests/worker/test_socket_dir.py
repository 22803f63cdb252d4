"""Socket directories: under TMPDIR when their sockets' paths fit a Unix socket address, else /tmp."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import zmq

from l3worker.worker.socket_dir import make_socket_dir


def _bind_and_close(directory: str) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{directory}/api-0-outputs")  # the longest name the project writes there
        sock.close(linger=0)
    finally:
        ctx.term()


def test_a_short_tmpdir_holds_the_socket_dir(tmp_path: Path, monkeypatch) -> None:
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        d = make_socket_dir("l3worker-serve-")
        assert os.path.dirname(d) == str(short)
        _bind_and_close(d)
    finally:
        shutil.rmtree(short)


def test_a_long_tmpdir_falls_back_to_tmp(tmp_path: Path, monkeypatch) -> None:
    long = tmp_path / ("x" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    d = make_socket_dir("l3worker-serve-")
    try:
        assert os.path.dirname(d) == "/tmp"
        _bind_and_close(d)  # would raise "longer than 107 characters" under the long TMPDIR
    finally:
        shutil.rmtree(d)
