"""l3worker: an LLM decode runtime whose generated tokens pay for the model and nothing else.

The names below load on first use (PEP 562), as vLLM's do: `import l3worker.serving.cli` for a
`--help` or a bad flag then answers without importing torch and the engine."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt", "DistributedWorker",
           "Engine", "AsyncEngine", "RequestOutput", "CompletionOutput", "TokenLogprob", "RequestMetrics",
           "WorkerError", "EngineDeadError", "ChildDiedError", "ChildError", "StepTimeoutError", "ChildFailure",
           "EngineBusyError", "RequestFailedError"]

# Where each name is defined: the first lookup of a name imports its module.
_MODULES = {
    "l3worker.entrypoints.llm": ("LLM",),
    "l3worker.entrypoints.inputs": ("TextPrompt", "TokensPrompt"),
    "l3worker.params": ("SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
                        "TokenLogprob", "RequestMetrics"),
    "l3worker.worker.distributed_worker": ("DistributedWorker",),
    "l3worker.engine.step_loop": ("Engine", "EngineDeadError"),
    "l3worker.serving.async_engine": ("AsyncEngine",),
    "l3worker.errors": ("WorkerError", "ChildDiedError", "ChildError", "StepTimeoutError", "ChildFailure",
                        "EngineBusyError", "RequestFailedError"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs resolve the names to
    from l3worker.engine.step_loop import Engine, EngineDeadError
    from l3worker.entrypoints.inputs import TextPrompt, TokensPrompt
    from l3worker.entrypoints.llm import LLM
    from l3worker.errors import (ChildDiedError, ChildError, ChildFailure, EngineBusyError, RequestFailedError,
                                 StepTimeoutError, WorkerError)
    from l3worker.params import (CompletionOutput, RequestMetrics, RequestOutput, SamplingParams,
                                 StructuredOutputsParams, TokenLogprob)
    from l3worker.serving.async_engine import AsyncEngine
    from l3worker.worker.distributed_worker import DistributedWorker


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'l3worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
