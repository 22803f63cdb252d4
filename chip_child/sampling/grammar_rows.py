"""The rows held to a grammar, in the chip-child: their matchers live beside the sampler.

Why here: the child knows a sampled token first. The next step's mask is filled on the host while
that step's forward runs on the device, and the parent keeps every command in flight for every
row (a matcher in the parent would have to see each token before it could send the next mask:
pipeline depth 1 for the whole batch).

Per step (chip_child.step.runtime.ChipRuntime): a command's admits and finished rows come in first;
between the forward and the sampler, `fill` takes the previous step's sampled ids of the
constrained rows (on an accelerator it waits for them, but they were ready before this step's
forward started), advances their matchers, and writes the mask row of every constrained row that
samples in this step into a host buffer that the runtime copies to the device. A grammar applies
after the row's first `after` token when one is given (the reasoning parser's `</think>`), and a
resumed row first replays the tokens it already produced. Every tensor-parallel rank runs the same
matchers on the same ids, so every rank applies the same mask without a collective.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import llguidance
import numpy as np
import torch

from chip_child.sampling.grammar import CompiledGrammar, GrammarCompiler, Matcher


def _broken(why: str) -> None:
    print(f"chip-child: a row's grammar {why}; its mask now allows every token", file=sys.stderr, flush=True)


@dataclass
class _Row:
    compiled: Future[CompiledGrammar] | None  # None: no tokenizer to compile with
    after: int  # the grammar starts after this token is first sampled; -1: at once
    started: bool
    todo: list[int] = field(default_factory=list)  # tokens for the matcher, taken in when it is next needed
    matcher: Matcher | None = None
    broken: bool = False  # it could not compile, or refused a token: its mask allows any token


class ConstrainedRows:
    """The matchers of a batch's constrained rows and the host bitmask their masks are filled into.

    `mask` is int32 [batch, ceil(V / 32)]: on the cpu the pooled device tensor itself (filled in
    place, nothing copied), elsewhere a pinned host buffer. Rows without a grammar keep every bit set.
    `copied` (accelerators) is the event after the last copy out of it: waited for before writing."""

    def __init__(self, compiler: GrammarCompiler | None, mask: torch.Tensor):
        self.compiler = compiler
        self.mask = mask
        self.copied = None
        self.rows: dict[int, _Row] = {}
        self._pending: tuple[torch.Tensor, object, list[int]] | None = None  # (ids, their event, rows)
        self._executor: llguidance.LLExecutor | None = None  # llguidance's threads, made at the first batch fill
        mask.fill_(-1)
        self.words = mask.shape[1]

    @staticmethod
    def compiler_for(model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler | None:
        """The checkpoint's compiler, its token trie building on a thread (GrammarCompiler.warm;
        `ready` waits for it); None without a tokenizer.json (the parent sends grammars only where
        there is one; warm-up's then allows any token)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        compiler = GrammarCompiler(path, vocab_size, eos_token_ids)
        compiler.warm()
        return compiler

    def ready(self) -> None:
        """Waits for that build: the child reports ready only after it, since the build holds the
        interpreter lock and would stall the first steps (GrammarCompiler.warm)."""
        if self.compiler is not None:
            self.compiler.ready()

    def admit(self, row: int, grammar: bytes, after: int, replay: np.ndarray) -> None:
        """A sequence takes `row` with this grammar text; `replay`: the tokens it already produced."""
        self._drop_pending(row)
        compiled = self.compiler.submit(grammar.decode()) if self.compiler is not None else None
        r = _Row(compiled, after, after < 0)
        self.rows[row] = r
        for token in replay.tolist():
            self._take(r, token)

    def finish(self, rows: Sequence[int]) -> None:
        """Rows left: their matchers go and their mask rows allow any token again."""
        gone = [row for row in rows if self.rows.pop(row, None) is not None]
        if gone:
            self._drop_pending(*gone)
            self._wait_copied()
            self.mask[gone] = -1

    def sampled(self, ids: torch.Tensor, done: object, rows: list[int]) -> None:
        """A step sampled `ids` (indexed by row; on an accelerator valid once the event `done`
        fired) for these constrained rows: their matchers take them at the next `fill`."""
        self._pending = (ids, done, rows) if rows else None

    def fill(self, rows: list[int]) -> None:
        """Advances every matcher by the previous step's token, then fills the mask row of each of
        `rows` (the constrained rows that sample in this step)."""
        if self._pending is not None:
            ids, done, previous = self._pending
            self._pending = None
            if done is not None:
                done.synchronize()
            values = ids.tolist()
            for row in previous:
                self._take(self.rows[row], values[row])
        self._wait_copied()
        ready = []
        for row in rows:
            r = self.rows[row]
            matcher = self._ready(r)
            if matcher is None or not r.started:
                self.mask[row] = -1
            else:
                ready.append((matcher, row))
        if len(ready) == 1:
            ready[0][0].fill_bitmask(self.mask[ready[0][1]])
        elif ready:  # a batch of rows: in parallel, off the interpreter lock
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            Matcher.fill_bitmasks(self._executor, ready, self.mask)

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _take(r: _Row, token: int) -> None:
        if r.started:
            r.todo.append(token)
        elif token == r.after:
            r.started = True

    @staticmethod
    def _ready(r: _Row) -> Matcher | None:
        """The row's matcher with every token taken in; None once it is broken. A broken row's
        mask allows any token: the parent's shadow matcher then refuses the request's next token
        and fails it with an error (l3worker.engine.outputs), so the break is said here, once."""
        if r.matcher is None and not r.broken:
            try:
                r.matcher = r.compiled.result().matcher() if r.compiled is not None else None
            except Exception as exc:  # the parent compiled the same text: only a child without the tokenizer gets here
                _broken(f"did not compile: {exc}")
                r.matcher = None
            r.broken = r.matcher is None
        if r.matcher is not None and r.todo:
            for token in r.todo:
                if r.matcher.is_terminated():  # run-ahead past the end: the parent drops these tokens
                    break
                if not r.matcher.accept(token):
                    _broken(f"refused token {token}")
                    r.broken = True
                    break
            r.todo.clear()
        return None if r.broken else r.matcher

    def _drop_pending(self, *rows: int) -> None:
        if self._pending is not None:
            ids, done, previous = self._pending
            self._pending = (ids, done, [r for r in previous if r not in rows])

    def _wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
