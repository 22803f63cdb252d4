"""vLLM's module path for the prompt types (`from vllm.inputs import TokensPrompt` switches by
renaming the package alone); they live in l3worker.entrypoints.inputs."""
from l3worker.entrypoints.inputs import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
