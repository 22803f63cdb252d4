"""Incremental detokenization of one sample, with stop strings matched on the host.

Each token goes through a `tokenizers` DecodeStream, which holds back the bytes of a character
that is not complete yet, so no delta ever carries half a multi-byte character. Stop strings
are searched only in the tail that a new piece can complete; a streamed delta holds back the
last `max(len(stop)) - 1` characters, which could be the start of a stop string.
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class SampleText:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, stop: tuple[str, ...],
                 include_stop_str_in_output: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters already handed out as deltas

    def add(self, token: int) -> str | None:
        """Appends a token's text; returns the stop string it completed, if any (the text then
        ends before it, or after it with include_stop_str_in_output)."""
        piece = self._stream.step(self._tokenizer, token)
        if not piece:
            return None
        start = max(0, len(self.text) - self._hold)  # a match must end inside the new piece
        self.text += piece
        if not self._stop:
            return None
        found, at = None, len(self.text)
        for s in self._stop:
            i = self.text.find(s, start)
            if 0 <= i < at:
                found, at = s, i
        if found is not None:
            self.text = self.text[:at + len(found) if self._include_stop else at]
        return found

    def finish(self, tokens: list[int], stopped_by_string: bool) -> None:
        """Final text: bytes the stream still holds (an incomplete character at the very end)
        come out as the full decode shows them."""
        if stopped_by_string:
            return
        full = self._tokenizer.decode(tokens, skip_special_tokens=self._skip_special)
        if full.startswith(self.text):
            self.text = full

    def delta(self, final: bool) -> str:
        """Text not handed out yet; before the end, minus what could still start a stop string."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out
