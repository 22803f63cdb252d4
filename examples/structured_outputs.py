"""Structured outputs through the OpenAI API: a JSON-schema response, the client's pydantic parsing,
and vLLM's `structured_outputs` field for a regex and a choice.

    python examples/structured_outputs.py        # starts `l3worker serve` (built-in tiny model) for the run
    python examples/structured_outputs.py --base-url http://127.0.0.1:8000

A grammar masks every token the constraint does not allow before sampling, so the reply matches
the schema, regex or choice whatever the model; the built-in tiny model has random weights, so
the values it picks are random.
"""
from __future__ import annotations

import json
import sys
from typing import Literal

import pydantic
from openai import OpenAI

from local_server import example_parser, server_for

# Bounded strings, numbers and arrays: a model can always finish the object within max tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral"]


class User(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


def main(argv: list[str] | None = None) -> int:
    args = example_parser(__doc__).parse_args(argv)
    with server_for(args) as (base_url, model):
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key)
        messages = [{"role": "user", "content": "Describe a user as JSON."}]

        # OpenAI's response_format with a JSON schema.
        reply = client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=200, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}})
        print(f"json_schema: {reply.choices[0].message.content}")
        print(f"  parsed: {json.loads(reply.choices[0].message.content)}")

        # The client's parse() with a pydantic model (it sends the model's JSON schema).
        parsed = client.chat.completions.parse(model=model, messages=messages, response_format=User,
                                               max_completion_tokens=200, seed=2)
        print(f"pydantic: {parsed.choices[0].message.parsed!r}")

        # vLLM's structured_outputs field, here on /v1/completions: a regex, then a choice.
        code = client.completions.create(model=model, prompt="Ticket code:", max_tokens=16, seed=3,
                                         extra_body={"structured_outputs": {"regex": REGEX}})
        print(f"regex: {code.choices[0].text}")
        label = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Classify: 'what a lovely day'"}],
            max_completion_tokens=8, seed=4, extra_body={"structured_outputs": {"choice": CHOICES}})
        print(f"choice: {label.choices[0].message.content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
