"""Structured outputs in the parent: compiling a request's grammar, holding it until then, and
following each sample's tokens to end it when its grammar does.

The masks are the chip-child's (chip_child.sampling.grammar_rows), applied before sampling. The parent
compiles the same grammar text first: to refuse what the tokenizer cannot serve, and so that a
request joins the batch only once its grammar is ready (the child's compile of it is then a cache
miss of a few milliseconds, off its step loop too). Until then the request waits in the engine's
grammar gate (l3worker.engine.grammar_gate), not in the scheduler's queue. Each sample keeps a
shadow matcher that takes the tokens the parent receives: when the grammar is complete and allows
nothing more, the sample finishes with "stop" even without eos; a token the grammar refuses fails
the request with an error, never a "stop".
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from chip_child.sampling.grammar import CompiledGrammar, GrammarCompiler, Matcher


class ParentGrammars:
    """The engine's grammar compiler. `warm` builds its token trie while the worker's children
    start (the build holds the interpreter lock, which under traffic would stall the step loop);
    otherwise it is made at the first constrained request."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]):
        self.path = Path(model_dir) / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.path.is_file()

    def _get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.path, self.vocab_size, self.eos_token_ids)
            return self._compiler

    def warm(self) -> None:
        """Starts building the token trie on a thread (GrammarCompiler.warm), where there is a tokenizer."""
        if self.available:
            self._get().warm()

    def ready(self) -> None:
        """Waits for the build warm() started."""
        if self._compiler is not None:
            self._compiler.ready()

    def submit(self, spec) -> Future[CompiledGrammar]:
        return self._get().submit(spec)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


@dataclass
class SampleGrammar:
    """One sample's shadow matcher: it starts after the first `after` token (-1: at once)."""

    matcher: Matcher
    after: int = -1
    started: bool = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.after < 0

    def take(self, token: int) -> str | None:
        """Takes the sample's next token: "complete" when the grammar is complete and allows
        nothing more, "refused" when the grammar does not allow the token (the child's mask
        allows any token once its matcher broke), None while the grammar goes on."""
        if not self.started:
            self.started = token == self.after
            return None
        if self.matcher.is_terminated():
            return "complete"
        if not self.matcher.accept(token):
            return "refused"
        return "complete" if self.matcher.is_terminated() else None
