"""l3worker: an LLM decode runtime whose generated tokens pay for the model and nothing else."""
from l3worker.serving.async_engine import AsyncEngine
from l3worker.engine.step_loop import Engine, EngineDeadError
from l3worker.errors import (ChildDiedError, ChildError, ChildFailure, EngineBusyError, RequestFailedError,
                             StepTimeoutError, WorkerError)
from l3worker.params import (CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, StructuredOutputsParams,
                             TokenLogprob)
from l3worker.worker.distributed_worker import DistributedWorker
from l3worker.entrypoints.inputs import TextPrompt, TokensPrompt
from l3worker.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt", "DistributedWorker",
           "Engine", "AsyncEngine", "RequestOutput", "CompletionOutput", "TokenLogprob", "RequestMetrics",
           "WorkerError", "EngineDeadError", "ChildDiedError", "ChildError", "StepTimeoutError", "ChildFailure",
           "EngineBusyError", "RequestFailedError"]
