"""vLLM's module path for the sampling types (`from vllm.sampling_params import ...` switches by
renaming the package alone); they live in l3worker.params."""
from l3worker.params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
