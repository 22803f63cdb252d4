"""Checkpoints this runtime does not implement are refused by name, in the parent, before any
child starts: an ignored quantization config would load quantized data as plain weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from chip_child.models.loader import load_config, load_weights
from l3worker import DistributedWorker

from model_files import write_config

QUANT_CONFIGS = [
    pytest.param({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq", id="awq"),
    pytest.param({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq", id="gptq"),
    pytest.param({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", id="bitsandbytes"),
    pytest.param({"quant_method": "compressed-tensors"}, "compressed-tensors", id="compressed-tensors"),
    pytest.param({"quant_method": "something-new"}, "something-new", id="unknown"),
    pytest.param({"bits": 4}, "no quant_method", id="no-method"),
]


@pytest.mark.parametrize("qc, name", QUANT_CONFIGS)
def test_config_refuses_quantization_by_name(tmp_path: Path, qc: dict[str, Any], name: str) -> None:
    write_config(tmp_path, quantization_config=qc)
    with pytest.raises(ValueError, match=f"quantization_config.*{name}"):
        load_config(tmp_path)


def test_config_refuses_compression_config(tmp_path: Path) -> None:
    write_config(tmp_path, compression_config={"quant_method": "compressed-tensors"})
    with pytest.raises(ValueError, match="compression_config.*compressed-tensors"):
        load_config(tmp_path)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Gemma2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_config_refuses_architecture_by_name(tmp_path: Path, arch: str) -> None:
    write_config(tmp_path, architectures=[arch])
    with pytest.raises(ValueError, match=arch):
        load_config(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_weights_refuse_undeclared_quantized_tensors(make_checkpoint, tmp_path: Path, dtype: torch.dtype) -> None:
    """Quantized tensors with no quantization_config: refused, never cast as if they were weights."""
    src = make_checkpoint()
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.weight.*stored as (F8_E4M3|I8)"):
        load_weights(tmp_path, load_config(tmp_path), torch.float32)


def test_worker_refuses_before_any_child_starts(make_checkpoint, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_checkpoint()
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    started: list[Any] = []
    monkeypatch.setattr("l3worker.worker.distributed_worker.ChildProcess", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match="gptq"):
        DistributedWorker(str(tmp_path), device="cpu", device_ids=(0, 1), max_seq_len=64)
    assert started == []
