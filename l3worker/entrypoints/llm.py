"""`LLM`: vLLM's offline class, over one DistributedWorker.

    from l3worker import LLM, SamplingParams
    llm = LLM("Qwen/Qwen3-0.6B")           # LLM() or LLM(model=None): the built-in tiny model
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))

What differs from DistributedWorker is vLLM's behaviour: generate()/chat() without SamplingParams use
the checkpoint's generation_config.json over vLLM's defaults (get_default_sampling_params()), not
the worker's greedy default; `seed` (vLLM's default 0) seeds every request that has no seed of its
own, from one generator, so a program's run repeats; text prompts get the tokenizer's special
tokens. The worker starts in the constructor and stops at close(), at the end of a `with` block,
when the LLM is garbage collected, or at interpreter exit, whichever comes first.
"""
from __future__ import annotations

import os
import random
import weakref
from dataclasses import replace
from typing import Any, Sequence

from chip_child.models.loader import load_config
from chip_child.models.tiny_model import ensure_tiny_model
from l3worker.entrypoints.engine_args import worker_kwargs
from l3worker.entrypoints.generation_config import default_sampling_fields, default_sampling_params
from l3worker.entrypoints.inputs import EnginePrompt, conversations, engine_prompts, template_messages
from l3worker.entrypoints.tokenizer import LLMTokenizer
from l3worker.hub import resolve_model
from l3worker.params import RequestOutput, SamplingParams
from l3worker.worker.distributed_worker import DistributedWorker

DEFAULT_MAX_MODEL_LEN = 4096  # `l3worker serve`'s too: the model's context, up to this
_MAX_SEED = 2**63  # SamplingParams' bound
_CONTENT_FORMATS = ("auto", "string", "openai")


class LLM:
    """vLLM's `LLM(model, ...)`. `model` is a local checkpoint or a Hub id; None is the built-in
    tiny model. vLLM's engine arguments are mapped to DistributedWorker's (l3worker.entrypoints.
    engine_args: max_num_seqs -> max_batch_size, max_model_len -> max_seq_len, enforce_eager ->
    decode_graphs=False, ...) or refused by name; DistributedWorker's own keywords pass through.
    `max_model_len` defaults to the model's context, up to 4096."""

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | os.PathLike | None = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 download_dir: str | None = None, seed: int | None = 0, enforce_eager: bool = False,
                 generation_config: str = "auto", override_generation_config: dict[str, Any] | None = None,
                 **kwargs: Any):
        if tokenizer is not None and str(tokenizer) != str(model):
            raise ValueError(f"tokenizer={str(tokenizer)!r}: l3worker reads the tokenizer from the model's own "
                             "tokenizer.json; leave tokenizer None")
        if tokenizer_revision is not None and tokenizer_revision != revision:
            raise ValueError("tokenizer_revision: the tokenizer comes with the model; give revision only")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")
        given = dict(kwargs)
        if enforce_eager:
            given["enforce_eager"] = enforce_eager
        options = worker_kwargs(given)
        # The model's files, found once: the worker is handed the directory.
        model_dir = str(ensure_tiny_model()) if model is None else resolve_model(model, revision, download_dir)
        if "max_seq_len" not in options:
            config = load_config(model_dir, options.get("quantization"))
            options["max_seq_len"] = min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)
        default_fields = default_sampling_fields(model_dir, generation_config, override_generation_config)
        self.worker = DistributedWorker(None if model is None else model_dir, **options)
        self.model_dir = self.worker.model_dir
        default = default_sampling_params(default_fields)
        try:
            default.validate(self.worker.model_config.vocab_size)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config: {e}") from None
        self._default_params = default
        self._seeds = random.Random(seed) if seed is not None else None
        self._tokenizer = LLMTokenizer(self.worker.tokenizer, self.model_dir) \
            if self.worker.tokenizer is not None else None
        # Closes the worker however the LLM goes away; close() runs it at once. It holds the worker,
        # never the LLM, so it does not keep the LLM alive.
        self._finalizer = weakref.finalize(self, self.worker.close)
        try:
            self.worker.prepare()  # vLLM loads the model in the constructor: errors surface here
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the chip-children and removes their sockets and shared memory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what vLLM's LLM offers --------------------------------------------------------------------
    def get_tokenizer(self) -> LLMTokenizer | None:
        """The model's tokenizer (encode, decode, apply_chat_template, ...); None when the model has
        no tokenizer.json."""
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without SamplingParams: vLLM's defaults, with the fields
        the model's generation_config.json sets."""
        return self._default_params

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, lora_request: Any = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One final RequestOutput per prompt, in order. `prompts`: a str, a TextPrompt or
        TokensPrompt dict, a list of token ids, or a list of those. `priority`: one per prompt
        (LLM(..., scheduling_policy="priority"); lower runs first). `lora_request`: a LoRARequest, or
        one per prompt (LLM(..., enable_lora=True))."""
        if not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be a bool, got {type(use_tqdm).__name__}")
        encode = None if self._tokenizer is None else self._tokenizer.encode  # special tokens added, as vLLM does
        return self._run(engine_prompts(prompts, encode), sampling_params, use_tqdm, priority, lora_request)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Renders each conversation (a list of {"role", "content"} messages; or a list of such
        lists) with the model's chat template (or `chat_template`: a template or a file holding
        one), then generates as generate() does. `chat_template_kwargs` are template variables
        (enable_thinking, ...) and may override the named arguments, as in vLLM."""
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported by l3worker")
        if chat_template_content_format not in _CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {_CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        if self._tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json, so chat messages cannot be tokenized")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError("chat_template_kwargs must be a dict")
        options: dict[str, Any] = dict(add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       chat_template=chat_template)
        options.update(chat_template_kwargs or {})  # vLLM lets these override the named arguments
        reserved = sorted({"messages", "conversation", "tokenize", "return_dict", "return_tensors"} & set(options))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there (chat() renders the "
                             "messages it is given and tokenizes them itself)")
        content_format = "openai" if chat_template_content_format == "openai" else "string"
        convs = conversations(messages)
        prompts = []
        for i, conv in enumerate(convs):
            text = self._tokenizer.apply_chat_template(
                template_messages(conv, content_format, i if len(convs) > 1 else -1), tokenize=False, **options)
            # the template wrote the special tokens: none are added again
            prompts.append(EnginePrompt(self._tokenizer.encode(text, add_special_tokens=False), text))
        return self._run(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    # -- LoRA adapters (DistributedWorker's, l3worker.worker.lora_controls) --------------------------
    def add_lora(self, lora_request) -> bool:
        return self.worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.worker.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.worker.list_loras()

    # -- RL rollouts (DistributedWorker's, l3worker.worker.rollout) ----------------------------------
    def sleep(self, level: int = 1) -> dict:
        """vLLM's: frees the KV cache (level 1) or the KV cache and the weights (level 2); needs
        LLM(..., enable_sleep_mode=True)."""
        return self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        return self.worker.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        self.worker.reset_prefix_cache()
        return True

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        return self.worker.update_weights_from_disk(model_path, weight_version)

    def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None,
                                   flush: bool = True) -> dict:
        return self.worker.update_weights_from_tensor(named_tensors, weight_version, flush)

    # -- internals ---------------------------------------------------------------------------------
    def _run(self, prompts: list[EnginePrompt], sampling_params: Any, use_tqdm: bool,
             priority: Sequence[int] | None = None, lora_request: Any = None) -> list[RequestOutput]:
        params = self._params_for(len(prompts), sampling_params)
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority: {len(priority)} values for {len(prompts)} prompts (give one per prompt)")
            params = [replace(p, priority=v) for p, v in zip(params, priority)]
        outputs = self.worker.generate([p.ids for p in prompts], params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt.text  # the worker was given ids
        return outputs

    def _params_for(self, count: int, sampling_params: Any) -> list[SamplingParams]:
        """One SamplingParams per prompt, each with a seed from the LLM's generator when it has none."""
        if sampling_params is None:
            sampling_params = self._default_params
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * count
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != count:
                raise ValueError(f"sampling_params: {len(params)} SamplingParams for {count} prompts (give one, or "
                                 "one per prompt)")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}")
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if self._seeds is None:
            return params
        return [p if p.seed is not None else replace(p, seed=self._seeds.randrange(_MAX_SEED)) for p in params]
