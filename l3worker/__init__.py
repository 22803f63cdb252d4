"""l3worker: an LLM decode runtime whose generated tokens pay for the model and nothing else."""
from l3worker.errors import ChildDiedError, ChildError, StepTimeoutError, WorkerError
from l3worker.params import RequestMetrics, RequestOutput, SamplingParams
from l3worker.worker import DistributedWorker

__all__ = ["DistributedWorker", "SamplingParams", "RequestOutput", "RequestMetrics", "WorkerError",
           "ChildDiedError", "ChildError", "StepTimeoutError"]
