"""Structured outputs, reasoning and tool calls: request fields to grammars, the parent's compiled
grammars, the reasoning and tool-call parsers. May import only the child's grammar engine (sampling/)."""
