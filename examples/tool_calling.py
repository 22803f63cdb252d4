"""Tool calling through the OpenAI API: a request with `tools`, the three ways to choose a tool, and
the round trip that sends the tool's result back.

    python examples/tool_calling.py              # starts `l3worker serve --enable-auto-tool-choice
                                                 #   --tool-call-parser hermes` (built-in tiny model)
    python examples/tool_calling.py --base-url http://127.0.0.1:8000

- tool_choice "auto": the model decides; `<tool_call>` blocks in its reply become `tool_calls`
  (needs --enable-auto-tool-choice --tool-call-parser hermes on the server).
- tool_choice "required" or a named function: the reply is held by a grammar to calls of the
  listed functions with arguments that match their parameters, whatever the model.

The built-in tiny model has random weights: with "auto" it writes noise and calls nothing; with
"required" or a named function its calls are valid, though its choice of arguments is random.
"""
from __future__ import annotations

import json
import sys

from openai import OpenAI

from local_server import example_parser, server_for

SERVE_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Tokyo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}]


def get_weather(city: str, unit: str) -> dict:
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


def main(argv: list[str] | None = None) -> int:
    args = example_parser(__doc__).parse_args(argv)
    with server_for(args, *SERVE_FLAGS) as (base_url, model):
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        choices = {"auto": "auto", "required": "required",
                   "named": {"type": "function", "function": {"name": "get_weather"}}}
        for label, tool_choice in choices.items():
            reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                   tool_choice=tool_choice, max_completion_tokens=200, seed=1)
            message = reply.choices[0].message
            print(f"tool_choice {label}: finish_reason={reply.choices[0].finish_reason}")
            for call in message.tool_calls or []:
                print(f"  call {call.id} {call.function.name} {call.function.arguments}")
            if not message.tool_calls:
                print(f"  content {message.content!r}")

        # The round trip: run the call the model asked for, send its result back, get the answer.
        if message.tool_calls:
            call = message.tool_calls[0]
            result = get_weather(**json.loads(call.function.arguments))
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
            final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                   tool_choice="none", max_completion_tokens=32)
            print(f"answer after the tool result: {final.choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
