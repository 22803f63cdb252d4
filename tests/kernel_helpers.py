"""Helpers for tests of chip_child.cpu_kernels."""
from __future__ import annotations

import pytest

from chip_child.cpu_kernels.build import CheckedKernel


def decide_again(monkeypatch: pytest.MonkeyPatch, kernel: CheckedKernel) -> None:
    """`kernel` decides again (build, check, environment) in this test; the process's verdict
    comes back after it."""
    for name, value in (("_decided", False), ("_lib", None), ("_why", None)):
        monkeypatch.setattr(kernel, name, value)
