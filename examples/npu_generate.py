"""Offline generation with one long-lived DistributedWorker, printing what each request cost.

    python examples/npu_generate.py                                  # built-in story model
    python examples/npu_generate.py --model-dir /path/to/Qwen3-0.6B --device npu --prompt "Hello"
    python examples/npu_generate.py --requests 3 --profile           # later requests skip setup
    python examples/npu_generate.py --stream                         # text as it is generated

Exit status: 0 done, 2 bad flag or input, 1 the worker failed, 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import sys

from chip_child.models.story_model import story_model_dir
from l3worker import DistributedWorker, SamplingParams, WorkerError

DEFAULT_PROMPTS = (  # story openings: what the built-in model knows, and fine for any other
    "Once upon a time",
    "One day, a little fox named Max",
    "Lily was a shy bird who",
    "But one day, Tom",
    "The brave rabbit went to the forest.",
    "Then a kind owl named Zoe came by.",
    "Sam loved to play with a red kite.",
    "From that day on,",
)
PROFILE_ROWS = (  # (label, key in decode_step, scale to print)
    ("parent wall (ms)", "parent_wall_s", 1e3), ("parent wait (ms)", "wait_s", 1e3),
    ("child apply (ms)", "apply_s", 1e3), ("device time (ms)", "device_s", 1e3),
    ("command bytes", "command_bytes", 1), ("H2D copies", "h2d_copies", 1),
    ("H2D bytes", "h2d_bytes", 1), ("pool allocations", "pool_allocs", 1),
)


def device_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="Hugging Face Qwen3 checkpoint directory or Hub id (default: the built-in "
                   "story model, about 0.6M parameters trained on generated children's stories)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable). Text when the model has a "
                   "tokenizer.json; without one, comma-separated token ids, e.g. '12,7,99'")
    p.add_argument("--num-prompts", type=int, default=4, help="without --prompt: how many default prompts "
                   "(varied texts; as token ids, their UTF-8 bytes modulo the vocab size, when the model has "
                   "no tokenizer.json) (default 4)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--device-ids", type=device_ids, default=(0,), help="comma list (default 0)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16, help="batch rows (max_batch_size)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV page size in tokens (default: 16 on the CPU, 128 on NPUs and GPUs)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--pipeline-depth", type=int, default=2, help="step commands kept in flight")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step: decode rows plus prefill chunks (default: the larger of 256 and "
                        "--max-num-seqs)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute shared prompt prefixes instead of reusing their KV pages")
    p.add_argument("--stream", action="store_true", help="print each request's text as it is generated")
    p.add_argument("--copy-policy", choices=("dirty", "always"), default="dirty")
    p.add_argument("--requests", type=int, default=1, help="sequential generate() calls on one worker")
    p.add_argument("--profile", action="store_true", help="print the per-decode-step breakdown")
    return p


def make_prompts(args: argparse.Namespace, w: DistributedWorker) -> list:
    vocab = w.model_config.vocab_size
    if args.prompt:
        if w.tokenizer is not None:
            return list(args.prompt)
        try:
            return [[int(t) for t in p.replace(",", " ").split()] for p in args.prompt]
        except ValueError:
            raise ValueError(f"--prompt: {w.model_dir} has no tokenizer.json, so prompts must be token ids "
                             f"like '12,7,99'") from None
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] + (f" ({i // len(DEFAULT_PROMPTS) + 1})" if
             i >= len(DEFAULT_PROMPTS) else "") for i in range(args.num_prompts)]
    if w.tokenizer is not None:
        return texts
    return [[b % vocab for b in text.encode()] for text in texts]


def print_perf(stats: dict, outputs: list) -> None:
    g = stats["last_generate"]
    tokens = sum(len(o.token_ids) for o in outputs)
    decode_tokens = tokens - len(outputs)  # each request's first token comes from its prefill
    print(f"[perf] generated {tokens} tokens in {g['wall_s']:.3f}s -> {rate(tokens, g['wall_s']):.2f} tok/s "
          f"(overall, incl. prefill)")
    print(f"[perf] prefill/TTFT {g['ttft_s']['mean']:.3f}s | decode {g['decode_s']:.3f}s over "
          f"{g['decode_steps']} steps -> {rate(decode_tokens, g['decode_s']):.2f} tok/s "
          f"({g['tpot_s']['mean'] * 1e3:.2f} ms/token)")


def print_profile(stats: dict) -> None:
    steps = stats["last_generate"]["decode_step"]
    print(f"[profile] per decode step ({stats['last_generate']['decode_steps']} steps)")
    print(f"[profile] {'':<18}{'mean':>12}{'p50':>12}{'p99':>12}")
    for label, key, scale in PROFILE_ROWS:
        d = steps[key]
        print(f"[profile] {label:<18}" + "".join(f"{d[q] * scale:>12.3f}" for q in ("mean", "p50", "p99")))


def stream(w: DistributedWorker, prompts: list, params: SamplingParams) -> list:
    """Prints each delta as `[request id] text` as it arrives; returns the final outputs in order."""
    finals = {}
    for out in w.stream(prompts, params):
        for sample in out.outputs:
            if sample.delta_text:
                print(f"[{out.request_id}] {sample.delta_text!r}", flush=True)
        if out.finished:
            finals[out.request_id] = out
    return sorted(finals.values(), key=lambda o: int(o.request_id))


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    w = None
    try:
        w = DistributedWorker(
            args.model_dir or story_model_dir(), device_ids=args.device_ids, device=args.device, max_batch_size=args.max_num_seqs,
            max_seq_len=args.max_seq_len, page_size=args.block_size, dtype=args.dtype,
            pipeline_depth=args.pipeline_depth, copy_policy=args.copy_policy,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching)
        if args.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {args.requests}")
        prompts = make_prompts(args, w)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        params.validate(w.model_config.vocab_size)  # bad flags fail before the children start
        w.prepare()
        st = w.stats()
        print(f"[setup] prepared in {st['prepare_s']:.3f}s on {st['device']} ({st['dtype']})")
        for i in range(1, args.requests + 1):
            outputs = stream(w, prompts, params) if args.stream else w.generate(prompts, params)
            st = w.stats()
            if args.requests > 1:
                print(f"=== request {i}/{args.requests} ===")
            for out in outputs:
                if out.prompt is not None:
                    print(f"prompt: {out.prompt!r}")
                print(f"text: {out.text!r}")
                print(f"token_ids: {out.token_ids}")
                print(f"finish_reason: {out.finish_reason}")
            setup = st["last_generate"]["setup_s"] + (st["prepare_s"] if i == 1 else 0.0)
            note = f" (incl. the one-time prepare, {st['prepare_s']:.4f}s)" if i == 1 else ""
            print(f"[setup] request {i}: {setup:.4f}s{note}")
            print_perf(st, outputs)
            if args.profile:
                print_profile(st)
        return 0
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)  # a child's failure carries its traceback text
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if w is not None:
            w.close()


if __name__ == "__main__":
    sys.exit(main())
