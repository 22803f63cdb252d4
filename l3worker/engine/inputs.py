"""Prompts as users give them (text, token lists, int arrays, tensors) to int32 token ids."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from l3worker.params import SamplingParams

Prompt = str | Sequence[int] | np.ndarray


def as_prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, np.ndarray)) or is_tensor(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of ints, an int array or a list of those, "
                        f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: empty list")
    if all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def per_prompt(prompts, params, lora_request) -> list[tuple]:
    """(prompt, SamplingParams or None, LoRARequest or None) for each prompt of a generate() call:
    `params` and `lora_request` are one for all or one per prompt."""
    prompt_list = as_prompt_list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params_list = [params] * len(prompt_list)
    else:
        params_list = list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"params: {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
    for i, p in enumerate(params_list):
        if p is not None and not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompt_list)
    if len(loras) != len(prompt_list):
        raise ValueError(f"lora_request: {len(loras)} LoRARequests for {len(prompt_list)} prompts")
    return list(zip(prompt_list, params_list, loras))


def token_ids(prompt, tokenizer: Tokenizer | None, vocab: int, where: str, model_dir: str) -> np.ndarray:
    """int32 ids of one prompt; ValueError/TypeError naming `where` for anything unusable."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where} is text but {model_dir} has no tokenizer.json; pass token ids")
        ids = np.asarray(tokenizer.encode(prompt, add_special_tokens=False).ids, dtype=np.int64)
    else:
        if is_tensor(prompt):
            prompt = prompt.detach().cpu().numpy()
        if isinstance(prompt, np.ndarray):
            if not np.issubdtype(prompt.dtype, np.integer):
                raise TypeError(f"{where}: token array must have an integer dtype, got {prompt.dtype}")
            if prompt.ndim != 1:
                raise ValueError(f"{where}: token array must be 1-D, got shape {prompt.shape}")
            ids = prompt
        elif isinstance(prompt, (list, tuple)):
            # One check per distinct type, not per id: a long prompt is mostly one type.
            if not all(issubclass(t, (int, np.integer)) and not issubclass(t, bool) for t in set(map(type, prompt))):
                raise TypeError(f"{where}: token ids must be ints")
            try:
                ids = np.asarray(prompt, dtype=np.int64)
            except OverflowError:
                raise ValueError(f"{where}: token id outside [0, {vocab}) (vocab_size)") from None
        else:
            raise TypeError(f"{where}: unsupported prompt type {type(prompt).__name__}")
    if ids.size == 0:
        raise ValueError(f"{where}: empty prompt")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{where}: token id {bad} outside [0, {vocab}) (vocab_size)")
    return ids.astype(np.int32)


def is_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")
