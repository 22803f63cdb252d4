"""The cpu kernel for the seeded sampler's noise (chip_child/cpu_kernels/sampling_noise.cpp): the
torch version's bits, used by uniform_noise on the cpu, and refused by name when forced off."""
from __future__ import annotations

import pytest
import torch

from chip_child.cpu_kernels import sampling_noise
from chip_child.sampling import sampler
from chip_child.sampling.noise import torch_uniform_noise, vocab_hash
from chip_child.sampling.sampler import seed_key, uniform_noise
from kernel_helpers import decide_again

needs_kernel = pytest.mark.skipif(not sampling_noise.KERNEL.usable(),
                                  reason=f"kernel unusable here: {sampling_noise.KERNEL.why_not()}")


@needs_kernel
@pytest.mark.parametrize("vocab_size", [1, 17, 4096, 32000, 151936])
def test_the_kernel_gives_the_torch_versions_bits(vocab_size) -> None:
    g = torch.Generator().manual_seed(vocab_size)
    keys = torch.cat([torch.tensor([0, (1 << 32) - 1, seed_key(2 ** 70)]), torch.randint(0, 1 << 32, (13,), generator=g)])
    counters = torch.cat([torch.tensor([(1 << 33) + 5, 0, 1]), torch.randint(0, 1 << 40, (13,), generator=g)])
    vocab = vocab_hash(vocab_size, torch.device("cpu"))
    lib = sampling_noise.KERNEL.library()
    for rows in (16, 3, 1):  # more rows than threads, and fewer (a team of one per row)
        k, c = keys[:rows], counters[:rows]
        assert torch.equal(sampling_noise.uniform_noise(lib, k, c, vocab), torch_uniform_noise(k, c, vocab)), rows
    assert sampling_noise.uniform_noise(lib, keys[:0], counters[:0], vocab).shape == (0, vocab_size)


@needs_kernel
def test_uniform_noise_takes_the_kernel_on_the_cpu(monkeypatch) -> None:
    vocab = vocab_hash(64, torch.device("cpu"))
    keys, counters = torch.tensor([seed_key(1), seed_key(2)]), torch.tensor([3, 4])
    want = torch_uniform_noise(keys, counters, vocab)

    def refused(*args):
        raise AssertionError("the torch version ran")

    monkeypatch.setattr(sampler, "torch_uniform_noise", refused)
    assert torch.equal(uniform_noise(keys, counters, vocab), want)


def test_forced_off_the_torch_version_runs_and_says_why(monkeypatch, capsys) -> None:
    decide_again(monkeypatch, sampling_noise.KERNEL)
    monkeypatch.setenv("L3WORKER_REFERENCE_KERNELS", "cpu_sampling_noise")
    vocab = vocab_hash(64, torch.device("cpu"))
    keys, counters = torch.tensor([seed_key(1)]), torch.tensor([3])
    assert torch.equal(uniform_noise(keys, counters, vocab), torch_uniform_noise(keys, counters, vocab))
    assert sampling_noise.KERNEL.why_not() == "forced by L3WORKER_REFERENCE_KERNELS"
    assert "the sampling noise is hashed by torch ops, not the cpu_sampling_noise kernel" in capsys.readouterr().err
