"""Streaming with the official `openai` client: a chat reply and a completion, token by token, then
the finish reason and the token counts.

    python examples/openai_stream.py                  # starts `l3worker serve` (built-in tiny model) for the run
    python examples/openai_stream.py --base-url http://127.0.0.1:8000

The built-in tiny model has random weights: its text is noise, the stream's shape is any model's.
"""
from __future__ import annotations

import sys

from openai import OpenAI

from local_server import example_parser, server_for


def main(argv: list[str] | None = None) -> int:
    args = example_parser(__doc__).parse_args(argv)
    with server_for(args) as (base_url, model):
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key)

        # Chat: each chunk carries a delta; the last one before usage has the finish reason.
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me a short story."}],
            max_completion_tokens=32, temperature=0.8, seed=7, stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        print("chat: ", end="", flush=True)
        finish, usage = None, None
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:  # the last chunk: no choices, the whole request's usage
                usage = chunk.usage
        print(f"\nchat finish_reason: {finish}")
        print(f"chat usage: prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}")

        # Completions: the same, with text deltas.
        print("completion: ", end="", flush=True)
        for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                               temperature=0, stream=True):
            print(chunk.choices[0].text, end="", flush=True)
            finish = chunk.choices[0].finish_reason or finish
        print(f"\ncompletion finish_reason: {finish}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
