"""Offline chat with vLLM's `LLM` class: a two-turn conversation, then a batch of conversations,
rendered with the checkpoint's chat template and generated in this process, no server.

    python examples/offline_chat.py                               # the built-in tiny model
    python examples/offline_chat.py --model /path/to/Qwen3-0.6B   # a checkpoint directory or Hub id

`LLM.chat` renders each conversation with the model's chat template (the one `l3worker serve`
renders), then generates. The built-in tiny model has random weights and a ChatML template of
Qwen3's shape: its replies are noise, the conversation's mechanics are any model's.
"""
from __future__ import annotations

import argparse
import sys

from l3worker import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory or Hub id (default: the built-in tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    # vLLM's engine arguments; block_size 16 lets the second turn reuse the first one's KV pages.
    with LLM(args.model, max_num_seqs=4, max_model_len=1024, block_size=16) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1)
        no_thinking = {"enable_thinking": False}  # Qwen3's switch: answer at once
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Name a city in France."}]

        reply = llm.chat(messages, params, chat_template_kwargs=no_thinking, use_tqdm=False)[0]
        print(f"user: {messages[-1]['content']}")
        print(f"assistant: {reply.outputs[0].text!r} ({reply.outputs[0].finish_reason})")

        messages += [{"role": "assistant", "content": reply.outputs[0].text},
                     {"role": "user", "content": "And one in Norway?"}]
        reply = llm.chat(messages, params, chat_template_kwargs=no_thinking, use_tqdm=False)[0]
        print(f"user: {messages[-1]['content']}")
        print(f"assistant: {reply.outputs[0].text!r} ({reply.outputs[0].finish_reason}, "
              f"{reply.num_cached_tokens} prompt tokens from the prefix cache)")

        # Several conversations at once: one output each, in order.
        questions = ["What is 2 + 2?", "Say hello.", "Name a colour."]
        batch = [[{"role": "user", "content": q}] for q in questions]
        for question, out in zip(questions, llm.chat(batch, params, chat_template_kwargs=no_thinking,
                                                     use_tqdm=False)):
            print(f"batch: {question!r} -> {out.outputs[0].text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
