"""RL rollout figures: what sleep, wake and new weights cost against starting the model afresh.

On a random ~58M Qwen3 (scripts/bench_models.py) and a second one of the same shape, with one
worker (enable_sleep_mode): a fresh start (DistributedWorker.prepare), sleep level 1 and wake,
sleep level 2 and wake, update_weights_from_disk (seconds and GB/s of checkpoint), and
update_weights_from_tensor (through shared memory), each the median of --repeats, alternating
the two checkpoints so every update changes every weight. Memory freed by sleep is the child's
resident size on the cpu. Greedy tokens after each update are checked against a worker started
on that checkpoint.

    PYTHONPATH=. python scripts/bench_rollout.py [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import machine_info  # noqa: E402
from bench_models import write_random_qwen3  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from l3worker import DistributedWorker, SamplingParams  # noqa: E402

MODEL_58M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                 max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)
WORKER = dict(device="cpu", max_batch_size=16, max_seq_len=512, page_size=16)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def tokens(w: DistributedWorker) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in w.generate(PROMPTS, GREEDY)]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    try:
        run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    ckpts = [tmp / f"m{i}" for i in range(2)]
    for i, path in enumerate(ckpts):
        write_random_qwen3(path, MODEL_58M, seed=i)
    gb = sum(f.stat().st_size for f in ckpts[0].glob("*.safetensors")) / 1e9
    expected = []
    for path in ckpts:
        with DistributedWorker(str(path), **WORKER) as w:
            expected.append(tokens(w))
    fig: dict[str, list[float]] = {k: [] for k in ("fresh_start_s", "sleep1_s", "wake1_s", "sleep2_s", "wake2_s",
                                                   "update_disk_s", "update_tensor_s", "freed_mb")}
    for r in range(args.repeats):
        w = DistributedWorker(str(ckpts[0]), enable_sleep_mode=True, **WORKER)
        fig["fresh_start_s"].append(timed(w.prepare)[0])
        with w:
            tokens(w)
            t, slept = timed(lambda: w.sleep(1))
            fig["sleep1_s"].append(t)
            fig["freed_mb"].append(slept["freed_bytes"] / 2**20)
            fig["wake1_s"].append(timed(w.wake_up)[0])
            fig["sleep2_s"].append(timed(lambda: w.sleep(2))[0])
            fig["wake2_s"].append(timed(w.wake_up)[0])
            fig["update_disk_s"].append(timed(lambda: w.update_weights_from_disk(str(ckpts[1])))[0])
            assert tokens(w) == expected[1], "tokens after the update from disk differ from a fresh start's"
            state = load_file(str(ckpts[0] / "model.safetensors"))
            fig["update_tensor_s"].append(timed(lambda: w.update_weights_from_tensor(state))[0])
            assert tokens(w) == expected[0], "tokens after the tensor update differ from a fresh start's"
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in fig.items()}
    rows = [("fresh start (prepare)", med["fresh_start_s"], 1.0),
            ("sleep(1)", med["sleep1_s"], med["sleep1_s"] / med["fresh_start_s"]),
            ("wake_up() after level 1", med["wake1_s"], med["wake1_s"] / med["fresh_start_s"]),
            ("sleep(2)", med["sleep2_s"], med["sleep2_s"] / med["fresh_start_s"]),
            ("wake_up() after level 2", med["wake2_s"], med["wake2_s"] / med["fresh_start_s"]),
            ("update_weights_from_disk", med["update_disk_s"], med["update_disk_s"] / med["fresh_start_s"]),
            ("update_weights_from_tensor", med["update_tensor_s"], med["update_tensor_s"] / med["fresh_start_s"])]
    print(f"checkpoint {gb:.3f} GB, KV freed by sleep(1) {med['freed_mb']:.0f} MiB, median of {args.repeats}")
    print(f"{'operation':<28} {'seconds':>9} {'/ fresh start':>14}")
    for name, s, ratio in rows:
        print(f"{name:<28} {s:>9.3f} {ratio:>14.3f}")
    print(f"update from disk: {gb / med['update_disk_s']:.2f} GB/s; from tensors: {gb / med['update_tensor_s']:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "checkpoint_gb": gb, "median": med,
                                               "all": fig}, indent=2))


if __name__ == "__main__":
    main()
