"""LoRA's cost on a decode step: 16 rows over 4 adapters against the same 16 rows on the base model.

A random Qwen3 (--shape 58m: hidden 512, 8 layers, vocab 32000; --shape 0.6b: Qwen3-0.6B's, fp32 on
the cpu) and four random PEFT adapters of rank 16 on every projection (q/k/v/o/gate/up/down),
written as PEFT writes them. Three runs of 16
prompts x 64 new tokens each: the base model without LoRA slots (enable_lora=False), the base model
with --max-loras 4 slots allocated (every row on the base), and every row on an adapter, four rows
each. Per run, the median decode step's apply time in the child (StepRecord.apply_s: the command,
the forward and the sample); median of --repeats runs, the variants alternated.

    PYTHONPATH=. python scripts/bench_lora.py [--repeats 3] [--shape 58m|0.6b] [--new-tokens 64] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import write_random_qwen3  # noqa: E402

from l3worker import DistributedWorker, SamplingParams  # noqa: E402
from l3worker.lora import LoRARequest  # noqa: E402

COMMON = dict(max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)
SHAPES = {
    "58m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, **COMMON),
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **COMMON),
}
RANK, ROWS = 16, 16


def dims(model: dict) -> dict[str, tuple[int, int]]:
    hidden, inter, hd = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    q, kv = model["num_attention_heads"] * hd, model["num_key_value_heads"] * hd
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden), "gate": (hidden, inter),
            "up": (hidden, inter), "down": (inter, hidden)}


def write_peft_adapter(folder: Path, seed: int, model: dict) -> Path:
    """A PEFT LoRA checkpoint (adapter_config.json, adapter_model.safetensors) with random weights."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model["num_hidden_layers"]):
        for target, (d_in, d_out) in dims(model).items():
            place = "mlp" if target in ("gate", "up", "down") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{place}.{target}_proj"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": [f"{t}_proj" for t in dims(model)]}))
    return folder


def decode_step_ms(model: str, device: str, loras: list[LoRARequest | None] | None, new: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prompts = [[5 + i, 80, 17, 200 + i, 3, 9, 44, 2] for i in range(ROWS)]
    kw = dict(enable_lora=True, max_loras=4, max_lora_rank=RANK) if loras is not None else {}
    with DistributedWorker(model, device=device, max_batch_size=ROWS, max_seq_len=256, page_size=16, **kw) as w:
        w.generate(prompts, params, lora_request=loras)  # warm: adapters loaded, pages touched
        w.generate(prompts, params, lora_request=loras)
        steps = [s["apply_s"] for s in w.step_records() if not s["prefill"]]
    return statistics.median(steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=SHAPES, default="58m")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    model = SHAPES[args.shape]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        write_random_qwen3(tmp / "m", model, seed=0)
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(tmp / f"a{i}", i + 1, model))) for i in range(4)]
        variants = {"base, no LoRA slots": None, "base, 4 LoRA slots": [None] * ROWS,
                    "16 rows over 4 adapters": [adapters[i % 4] for i in range(ROWS)]}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, loras in variants.items():
                times[name].append(decode_step_ms(str(tmp / "m"), args.device, loras, args.new_tokens))
        base = statistics.median(times["base, no LoRA slots"])
        print(f"decode step, {args.shape} model, {ROWS} rows, rank-{RANK} adapters on every projection, {args.device}, "
              f"median of {args.repeats} runs:")
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"  {name:<26} {ms:7.2f} ms  ({ms / base:.3f}x)   runs: {', '.join(f'{v:.2f}' for v in values)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
