"""Reasoning through the OpenAI API: with `--reasoning-parser qwen3` the server returns a chat reply's
<think> block as `reasoning_content` (and `reasoning`, vLLM's newer name) apart from the answer in
`content`, whole or streamed.

    python examples/reasoning.py                 # starts `l3worker serve --reasoning-parser qwen3`
                                                 #   (built-in tiny model) for the run
    python examples/reasoning.py --base-url http://127.0.0.1:8000

`chat_template_kwargs={"enable_thinking": False}` renders an empty, closed think block into the
prompt (Qwen3's switch), so the whole reply is the answer. The built-in tiny model has random
weights and never opens a think block itself, so its reasoning is None either way; a Qwen3
checkpoint fills it.
"""
from __future__ import annotations

import sys

from openai import OpenAI

from local_server import example_parser, server_for

SERVE_FLAGS = ("--reasoning-parser", "qwen3")


def main(argv: list[str] | None = None) -> int:
    args = example_parser(__doc__).parse_args(argv)
    with server_for(args, *SERVE_FLAGS) as (base_url, model):
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key)
        messages = [{"role": "user", "content": "Which is larger, 9.11 or 9.9?"}]

        for thinking in (True, False):
            reply = client.chat.completions.create(
                model=model, messages=messages, max_completion_tokens=48, seed=5,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            message = reply.choices[0].message
            # Fields the openai client does not declare are attributes all the same.
            print(f"enable_thinking={thinking}: finish_reason={reply.choices[0].finish_reason}")
            print(f"  reasoning_content: {getattr(message, 'reasoning_content', None)!r}")
            print(f"  content: {message.content!r}")

        # Streamed: reasoning deltas and content deltas arrive in separate fields.
        reasoning, content = [], []
        for chunk in client.chat.completions.create(model=model, messages=messages, max_completion_tokens=48,
                                                    seed=5, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning.append(getattr(delta, "reasoning_content", None) or "")
                content.append(delta.content or "")
        print("streamed:")
        print(f"  reasoning_content: {''.join(reasoning) or None!r}")
        print(f"  content: {''.join(content) or None!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
