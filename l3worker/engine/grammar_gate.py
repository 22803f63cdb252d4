"""Requests whose structured-output grammar is still compiling wait here, not in the scheduler's
queue, so the requests behind them are admitted as usual; once compiled, each sample gets its
shadow matcher (l3worker.structured.request_grammars)."""
from __future__ import annotations

from typing import Callable

from l3worker.engine.requests import RequestState
from l3worker.structured.request_grammars import SampleGrammar


class GrammarGate:
    """Requests whose grammar is still compiling. `wake` is called when one finishes compiling."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._held: list[RequestState] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, state: RequestState) -> bool:
        """True when the request must wait for its grammar (it is held here until `release`)."""
        if state.grammar is None or state.grammar.done():
            return False
        self._held.append(state)
        state.grammar.add_done_callback(lambda _: self._wake())
        return True

    def release(self) -> list[RequestState]:
        """The held requests whose grammar is ready (aborted ones are dropped)."""
        ready = [s for s in self._held if s.finished or s.all_finished or s.grammar.done()]
        self._held = [s for s in self._held if s not in ready]
        return [s for s in ready if not (s.finished or s.all_finished)]


def attach_matchers(state: RequestState) -> str | None:
    """Gives each sample of a request whose grammar compiled its shadow matcher; the compile
    error's text if it failed."""
    try:
        compiled = state.grammar.result()
    except Exception as exc:  # ValueError naming the field: what the tokenizer cannot serve
        return str(exc)
    after = state.params.reasoning_end_token_id
    for seq in state.seqs:
        seq.grammar = SampleGrammar(compiled.matcher(), -1 if after is None else after)
    return None
