#!/usr/bin/env python
"""How many aten ops one decode step dispatches: the chip runtime's step vs a step of transformers'
generate loop, on the benchmark's checkpoint and prompts (bench_decode.py's workloads).

Where a model is as small as the overhead workload's, a step's time is mostly the host
dispatching ops, so this count explains much of the time difference. Ops are counted below
autograd (TorchDispatchMode), views included; both sides run in inference mode.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_decode import WORKLOADS, Floor, make_prompts, write_checkpoint  # scripts/, next to this file


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def runtime_ops(model_dir: str, workload: str) -> int:
    """Ops of the third steady decode step of ChipRuntime.execute (warm, no page boundary)."""
    wl = WORKLOADS[workload]
    floor = Floor(model_dir, wl, threads=1)
    cmds, staging = floor._commands(make_prompts(wl), wl.new_tokens)
    for cmd in cmds[:3]:
        floor.rt.execute(cmd, staging, floor.out)
    with OpCounter() as counter:
        floor.rt.execute(cmds[3], staging, floor.out)
    return counter.ops


def transformers_ops(model_dir: str, workload: str) -> int:
    """Ops between two consecutive decode steps of Qwen3ForCausalLM.generate (greedy, dynamic cache)."""
    from transformers import LogitsProcessor, LogitsProcessorList, Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.stack(make_prompts(WORKLOADS[workload])).astype(np.int64))
    counter = OpCounter()
    marks: list[int] = []

    class Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            marks.append(counter.ops)
            return scores

    with torch.inference_mode(), counter:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                       do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([Mark()]))
    return int(np.median(np.diff(marks)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="overhead")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="count-ops-") as model_dir:
        write_checkpoint(model_dir, WORKLOADS[args.workload])
        counts = {"runtime": runtime_ops(model_dir, args.workload),
                  "transformers": transformers_ops(model_dir, args.workload)}
    print(f"aten ops per decode step ({args.workload} workload): runtime {counts['runtime']}, "
          f"transformers generate {counts['transformers']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "ops_per_decode_step": counts}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
