"""Tensor parallel across two nodes against tensor parallel on one: time per output token.

Two cpu workers of tensor_parallel_size 2 on the same random Qwen3, prepared side by side: one
with both ranks on this node (device_ids=(0, 1)), one as the head of two loopback "nodes" (rank 1 in
a follower, `l3worker serve --headless`, a process tree of its own, driven over tcp:// ZeroMQ).
The same greedy batch runs on each in turn, --repeats times, alternating; TPOT p50 and decode
step figures are printed per run and as the median, with the ratio two-node / one-node. Last,
the follower is killed (SIGKILL) in the middle of a stream: the seconds until the head's worker
fails with an error naming the node (max_restarts=0 on the two-node worker, so it fails at once).

    PYTHONPATH=. python scripts/bench_tp_nodes.py [--repeats 5] [--batch 4] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import machine_info, random_prompts  # noqa: E402
from bench_models import write_random_qwen3  # noqa: E402
from l3worker import DistributedWorker, SamplingParams  # noqa: E402
from l3worker.errors import WorkerError  # noqa: E402
from l3worker.distributed.follower import follower_command  # noqa: E402
from l3worker.distributed.nodes import NodeLayout, free_master_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, tie_word_embeddings=False, max_position_embeddings=1024,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


def one_run(w: DistributedWorker, prompts, params: SamplingParams) -> dict:
    outs = w.generate(prompts, params)
    s = w.stats()["last_generate"]
    return {"tpot_p50_ms": round(s["tpot_s"]["p50"] * 1e3, 3),
            "decode_step_p50_ms": round(s["decode_step"]["parent_wall_s"]["p50"] * 1e3, 3),
            "max_command_bytes": s["max_command_bytes"], "tokens": [o.token_ids for o in outs]}


def follower_death(w: DistributedWorker, follower: subprocess.Popen, prompts) -> tuple[float, float, str]:
    """Seconds from the follower's SIGKILL to the engine's failure and to the caller's error (the
    worker closed by then: its rank-0 child stopped), and the error's first line."""
    failed_at: list[float] = []
    fail = w.engine.fail
    w.engine.fail = lambda exc: (failed_at.append(time.perf_counter()), fail(exc))
    stream = w.stream(prompts, SamplingParams(temperature=0.0, max_new_tokens=MODEL["max_position_embeddings"] - len(prompts[0]) - 1,
                                                   ignore_eos=True))
    next(stream)
    os.killpg(follower.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        for _ in stream:
            pass
    except WorkerError as exc:
        return failed_at[0] - t0, time.perf_counter() - t0, str(exc).splitlines()[0]
    raise AssertionError("the stream ended without an error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-nodes-"))
    nparams = write_random_qwen3(tmp / "model", MODEL)
    prompts = [p.tolist() for p in random_prompts(args.batch, args.prompt_len, MODEL["vocab_size"], seed=0)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    # Unpinned, both: a follower does not pin its children, and a second worker of one process
    # would not pin its own beside the first's.
    common = dict(device="cpu", max_batch_size=args.batch, max_seq_len=MODEL["max_position_embeddings"],
                  page_size=16, pin_cores=False)
    port = free_master_port(2)
    layout = NodeLayout(2, 2, 1, "127.0.0.1", port)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    follower = subprocess.Popen(follower_command(str(tmp / "model"), layout, "--device", "cpu"), cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    runs: dict[str, list[dict]] = {"one_node": [], "two_nodes": []}
    try:
        with DistributedWorker(str(tmp / "model"), device_ids=(0, 1), **common) as one, \
                DistributedWorker(str(tmp / "model"), tensor_parallel_size=2, nnodes=2, master_port=port,
                                  max_restarts=0, **common) as two:
            for w in (one, two):  # warm both before timing either
                w.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
            for _ in range(args.repeats):
                for name, w in (("one_node", one), ("two_nodes", two)):
                    runs[name].append(one_run(w, prompts, sampling))
            detect_s, raised_s, error = follower_death(two, follower, prompts)
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGTERM)
        follower.wait(30)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["one_node"], runs["two_nodes"]))
    median = {name: statistics.median(r["tpot_p50_ms"] for r in rs) for name, rs in runs.items()}
    ratios = [b["tpot_p50_ms"] / a["tpot_p50_ms"] for a, b in zip(runs["one_node"], runs["two_nodes"])]
    for rs in runs.values():
        for r in rs:
            del r["tokens"]
    print(json.dumps({
        "machine": machine_info(model_params=nparams, batch=args.batch,
                                prompt_len=args.prompt_len, new_tokens=args.new_tokens),
        "runs": runs, "tpot_p50_ms_median": median,
        "two_nodes_over_one_node_per_run": [round(x, 3) for x in ratios],
        "two_nodes_over_one_node_median": round(statistics.median(ratios), 3),
        "same_tokens": same,
        "follower_killed_to_engine_failure_s": round(detect_s, 3), "follower_killed_to_error_raised_s":
            round(raised_s, 3), "head_error": error,
    }, indent=1))


if __name__ == "__main__":
    main()
