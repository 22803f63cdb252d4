"""The grammar engine beside the sampler: compiled grammars, per-row matchers and token bitmasks.

llguidance (why, and what it costs, is in the README's "Structured outputs") builds token masks
on the fly from a `tokenizers` tokenizer.json. A grammar is llguidance's grammar text (what
l3worker.structured.specs.StructuredSpec.grammar() gives for a request's constraint); the chip-child
receives exactly that text in a row's admit, and the parent compiles the same text to validate
the request and to follow its tokens.

- `GrammarCompiler` (one per tokenizer) compiles in a thread pool, cached by spec or text; the
  tokenizer's token trie is built once, by `warm` or the first compile, holding the interpreter
  lock throughout.
- `Matcher` follows one sequence's tokens and fills its row of the packed int32 bitmask
  ([ceil(V / 32)] words, bit i of word w allows token 32 * w + i, the layout both llguidance and
  xgrammar use); `apply_bitmask` applies it to logits on any device.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import llguidance
import torch


# ---- compiling and matching -------------------------------------------------------------------


class Matcher:
    """One request's grammar state: accept the sampled tokens, fill the next step's mask row."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the matcher then stays
        in an error state: `error` says why)."""
        return self._m.consume_token(token_id)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into a contiguous int32 CPU row of ceil(V / 32) words."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("bitmask row must be a contiguous int32 CPU tensor")
        if row.numel() != bitmask_words(self.vocab_size):
            raise ValueError(f"bitmask row has {row.numel()} words, needs {bitmask_words(self.vocab_size)}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @staticmethod
    def fill_bitmasks(executor: llguidance.LLExecutor, matchers: list[tuple["Matcher", int]],
                      mask: torch.Tensor) -> None:
        """Fills row `i` of the int32 CPU bitmask `mask` [B, ceil(V / 32)] for each (matcher, i),
        all at once on llguidance's threads, without holding the interpreter lock."""
        if mask.dtype != torch.int32 or mask.device.type != "cpu" or not mask.is_contiguous() or mask.dim() != 2:
            raise ValueError("bitmask must be a contiguous 2-D int32 CPU tensor")
        executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in matchers], mask.data_ptr(), mask.shape[1] * 4,
                                         mask.shape[0])

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (or eos was accepted): the row stops."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (eos is allowed), though it may go on."""
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (run-ahead and speculation drop tokens)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


@dataclass
class CompiledGrammar:
    """A grammar compiled for one tokenizer; each sequence gets a cheap copy of the pristine matcher."""

    spec: Hashable  # what it was compiled from: a spec with a grammar() method, or grammar text
    _template: llguidance.LLMatcher
    vocab_size: int

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab_size)


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Compiles grammars for one tokenizer off the step loop: a thread pool and an LRU cache.

    A grammar is given as llguidance grammar text, or as a spec (hashable, with a `grammar()`
    method giving that text and a `field` naming it in errors), each its own cache key.
    `vocab_size` is the model's (its lm_head rows), which may exceed the tokenizer's: ids without
    a token are never allowed. `eos_token_ids` are the ids that end a reply (allowed once the
    grammar is complete). The tokenizer is built on the pool at the first compile, or by `warm()`.
    """

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 max_workers: int = 2, cache_size: int = 256) -> None:
        self._tokenizer_source = tokenizer_json
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[Hashable, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.stats = CompileStats()
        self._warming: Future | None = None  # warm()'s build

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                source = self._tokenizer_source
                text = Path(source).read_text() if _is_path(source) else str(source)
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tokenizer

    def warm(self) -> None:
        """Starts building the tokenizer on a thread of its own (`ready` waits for it).
        llguidance holds the interpreter lock for the whole build (about 0.25 s for a 64k BPE
        vocabulary, seconds where a tokenizer has tens of thousands of added tokens), so no thread
        of this process runs Python meanwhile: callers build it while they wait for something else,
        and before they serve. A compile that comes first waits for
        this build."""
        done: Future = Future()

        def build() -> None:
            try:
                done.set_result(self.tokenizer)
            except BaseException as e:  # a compile raises it again, with the request's context
                done.set_exception(e)

        threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()
        self._warming = done

    def ready(self) -> None:
        """Waits for a build warm() started (nothing if none did). A failed build is not raised
        here: the compiles that need the tokenizer raise it, each with its request's context."""
        if self._warming is not None:
            self._warming.exception()

    def submit(self, spec: Hashable) -> Future[CompiledGrammar]:
        """The compiled grammar, as a Future (done at once on a cache hit). A grammar the
        tokenizer cannot serve fails the Future with ValueError."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return fut
            self.stats.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: Hashable) -> CompiledGrammar:
        return self.submit(spec).result()

    def _compile(self, spec: Hashable) -> CompiledGrammar:
        text = spec if isinstance(spec, str) else spec.grammar()
        # llguidance builds the lexer and parser here, without the GIL
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            what = getattr(spec, "field", "") or getattr(spec, "kind", "") or "grammar"
            raise ValueError(f"{what}: {template.get_error()}")
        return CompiledGrammar(spec, template, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_path(value: str | Path) -> bool:
    return isinstance(value, Path) or not str(value).lstrip().startswith("{")


# ---- bitmasks ---------------------------------------------------------------------------------


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """[batch, ceil(V / 32)] int32, every token allowed (rows without a grammar stay so)."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size] from a packed int32 bitmask [B, W] on the same device; ids past the
    mask's words are never allowed. Plain tensor ops: any backend, and capturable in a graph."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place: logits [B, V] on any device, bitmask [B, W] int32.

    llguidance's own torch version wraps the same ops in torch.compile, which needs a C++ or
    Triton toolchain at first call; xgrammar ships fused CUDA/Triton kernels, a later option for
    CUDA only.
    """
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))
