"""`python -m l3worker serve` started with a vLLM user's flags: the model named by --model as typed,
--gpu-memory-utilization sizing the KV cache (reported in the ready line), --enforce-eager,
--trust-remote-code, --kv-cache-dtype auto, --seed, --enable-log-requests, and the checkpoint's
generation_config.json as sampling defaults; a checkpoint that needs its own code and a vLLM flag
l3worker lacks are refused with exit 2."""
from __future__ import annotations

import json
import math
import re
import shutil
import signal

import httpx

from chip_child.models.loader import load_config
from chip_child.models.tiny_model import ensure_tiny_model
from l3worker.worker.kv_sizing import cpu_memory_bytes, kv_bytes_per_token, size_kv_cache, weight_bytes
from model_files import write_config

QWEN3_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # what Qwen3 checkpoints ship
SMALL = ("--max-model-len", "128", "--block-size", "16", "--max-num-seqs", "2")


def test_vllm_flags_size_the_cache_and_set_the_defaults(served, tmp_path) -> None:
    ckpt = tmp_path / "Qwen3-tiny"
    shutil.copytree(ensure_tiny_model(), ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, **QWEN3_SAMPLING}))
    # a fraction of this machine's memory that holds the weights and about 200 pages
    cfg = load_config(ckpt)
    fraction = math.ceil(1e6 * (weight_bytes(cfg, 4) + 201 * 16 * kv_bytes_per_token(cfg, 4)) / cpu_memory_bytes()) / 1e6
    expected = size_kv_cache(cfg, fraction=fraction, kind="cpu", device_id=0, itemsize=4, local_ranks=1,
                             page_size=16, max_seq_len=128)
    s = served("--model", str(ckpt), "--device", "cpu", "--gpu-memory-utilization", str(fraction), "--enforce-eager",
               "--trust-remote-code", "--kv-cache-dtype", "auto", "--seed", "1", "--enable-log-requests",
               "--disable-log-stats", "--max-model-len", "128", "--max-num-seqs", "2")  # the CPU's pages: 16
    ready = s.ready()
    url, name = ready.groups()
    assert name == str(ckpt)  # served as typed, not as the directory's basename
    assert (f"kv cache {expected.num_pages} pages of 16 ({expected.tokens} tokens from gpu_memory_utilization "
            f"{fraction})") in ready.string
    assert f"sampling defaults temperature=0.6 top_p=0.95 top_k=20 from {ckpt / 'generation_config.json'}" \
        in ready.string
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == str(ckpt)
        c.post("/v1/completions", json={"model": str(ckpt), "prompt": "Hi", "max_tokens": 2})
        c.post("/v1/completions", json={"model": str(ckpt), "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.stderr[-20:]
    received = [line for line in s.stderr if "Received request" in line]
    assert len(received) == 2
    # the checkpoint's defaults fill what a request leaves out, and only that
    assert re.search(r"temperature=0\.6, top_p=0\.95, top_k=20,", received[0]), received[0]
    assert re.search(r"temperature=0\.0, top_p=0\.95, top_k=20,", received[1]), received[1]
    assert "seed=None" not in received[0]  # --seed gives unseeded requests one


def test_a_checkpoint_that_needs_its_own_code_is_refused_by_name(served, tmp_path) -> None:
    ckpt = write_config(tmp_path / "remote", architectures=["InternLM2ForCausalLM"],
                        auto_map={"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"})
    s = served(str(ckpt), "--trust-remote-code")
    assert s.proc.wait(60) == 2
    err = "\n".join(s.stderr)
    assert "InternLM2ForCausalLM" in err and "auto_map" in err and "never runs" in err, err


def test_a_vllm_flag_l3worker_lacks_exits_2_from_the_command(served) -> None:
    s = served("--swap-space", "4")
    assert s.proc.wait(60) == 2
    assert s.stderr[0].startswith("usage: l3worker serve")
    assert "l3worker serve: error: l3worker does not support --swap-space" in s.stderr
