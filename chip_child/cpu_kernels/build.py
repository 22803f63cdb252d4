"""Builds a kernel's C++ source into a shared library once per machine and loads it with ctypes.

The library lands in `$L3WORKER_KERNEL_CACHE` (default `~/.cache/l3worker/kernels`) under a name
hashed from the source, the flags and the compiler's version, so a changed source builds again
and concurrent builders (test workers, chip-children) each write a temporary file and rename it
into place. The library links OpenMP by its soname, libgomp.so.1: loaded after torch, it shares
torch's OpenMP runtime and thread pool instead of starting a second one."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library resolves libgomp.so.1 to torch's copy)

SOURCE_DIR = Path(__file__).parent
BUILD_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("L3WORKER_KERNEL_CACHE") or Path.home() / ".cache" / "l3worker" / "kernels")


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e


def build(source: str, flags: list[str]) -> Path:
    """The shared library of chip_child/cpu_kernels/`source`, built unless cached."""
    cxx = compiler()
    text = (SOURCE_DIR / source).read_bytes()
    key = hashlib.sha256(text + " ".join(flags).encode() + _compiler_version(cxx).encode()).hexdigest()[:16]
    target = cache_dir() / f"{Path(source).stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE_DIR / source)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-800:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{' '.join(cmd)} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: str, flags: list[str]) -> ctypes.CDLL:
    path = build(source, flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
