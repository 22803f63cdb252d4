"""Builds a kernel's C++ source into a shared library once per machine and loads it with ctypes.

The library lands in `$L3WORKER_KERNEL_CACHE` (default `~/.cache/l3worker/kernels`) under a name
hashed from the source, the shared headers beside it, the flags and the compiler's version, so a changed source builds again
and concurrent builders (test workers, chip-children) each write a temporary file and rename it
into place. The library links OpenMP by its soname, libgomp.so.1: loaded after torch, it shares
torch's OpenMP runtime and thread pool instead of starting a second one."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch  # noqa: F401  (loaded first: the library resolves libgomp.so.1 to torch's copy)

from chip_child.kernel_choice import forced_reference

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


@functools.cache  # once per process: every kernel's cache key reads it
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e


def build(source: str, flags: list[str]) -> Path:
    """The shared library of chip_child/cpu_kernels/`source` (or of the file at an absolute
    `source` path, which includes the headers here as well), built unless cached."""
    cxx = compiler()
    text = (SOURCE_DIR / source).read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(text + " ".join(flags).encode() + _compiler_version(cxx).encode()).hexdigest()[:16]
    target = cache_dir() / f"{Path(source).stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-I", str(SOURCE_DIR), "-shared", "-fPIC", "-o", tmp, str(SOURCE_DIR / source)]
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


AVX512_BF16 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")  # /proc/cpuinfo names of what both kernels need
AVX512_BF16_FLAGS = ["-std=c++17", "-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-fopenmp"]

AVX2_FMA = ("avx2", "fma")  # the cpus without AVX-512 BF16 that the *_avx2.cpp kernels serve
AVX2_FMA_FLAGS = ["-std=c++17", "-O3", "-mavx2", "-mfma", "-fopenmp"]


def missing_cpu_flags(flags: tuple[str, ...]) -> str | None:
    """None where /proc/cpuinfo lists every one of `flags`; else what is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo to read the cpu's flags from"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    missing = [f for f in flags if f not in line.split()]
    return f"this cpu lacks {', '.join(missing)}" if missing else None


class CheckedKernel:
    """One kernel library, built, loaded and checked once per process: `library()` is it, or None
    where it cannot be used, the reason printed once on stderr (after `fallback`) and kept in
    `why_not()`. `check(lib)` returns its largest relative error against torch; past `tolerance`
    the kernel is not used. `L3WORKER_REFERENCE_KERNELS=<name>` turns it off without building."""

    def __init__(self, name: str, source: str, fallback: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL],
                 check: Callable[[ctypes.CDLL], float], tolerance: float, cpu_flags: tuple[str, ...] = AVX512_BF16,
                 compile_flags: list[str] = AVX512_BF16_FLAGS):
        self.name, self.source, self.fallback = name, source, fallback
        self.bind, self.check, self.tolerance = bind, check, tolerance
        self.cpu_flags, self.compile_flags = cpu_flags, compile_flags
        self.reset()

    def reset(self) -> None:
        """Forgets the verdict: the next library() decides again (tests)."""
        self._decided, self._lib, self._why = False, None, None

    def _prepare(self) -> tuple[ctypes.CDLL | None, str | None]:
        if self.name in forced_reference():
            return None, "forced by L3WORKER_REFERENCE_KERNELS"
        missing = missing_cpu_flags(self.cpu_flags)
        if missing:
            return None, missing
        try:
            lib = self.bind(load(self.source, self.compile_flags))
        except KernelBuildError as e:
            return None, str(e)
        error = self.check(lib)
        if not error <= self.tolerance:  # a NaN fails too
            return None, f"it failed its self-check (relative error {error:.3g} against the torch reference)"
        return lib, None

    def library(self) -> ctypes.CDLL | None:
        if not self._decided:
            self._lib, self._why = self._prepare()
            self._decided = True
            if self._why:
                print(f"chip-child: {self.fallback}, not the {self.name} kernel: {self._why}", file=sys.stderr, flush=True)
        return self._lib

    def usable(self) -> bool:
        return self.library() is not None

    def why_not(self) -> str | None:
        self.library()
        return self._why


def first_usable(primary: CheckedKernel, *fallbacks: CheckedKernel) -> CheckedKernel | None:
    """The first of `primary` and `fallbacks` whose library runs here, or None. The primary's name in
    `L3WORKER_REFERENCE_KERNELS` turns them all off (the fallbacks are versions of the same kernel)."""
    if primary.name in forced_reference():
        primary.library()  # prints that it is forced off
        return None
    return next((k for k in (primary, *fallbacks) if k.library() is not None), None)
