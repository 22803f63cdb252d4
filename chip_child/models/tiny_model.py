"""A built-in, deterministic tiny Qwen3 checkpoint for tests and smoke runs.

Everything (weights, tokenizer, configs) is generated locally from a fixed
seed, so no download is ever needed and the files are byte-identical on every
write.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from chip_child.models.loader import ModelConfig, expected_tensor_shapes, load_config

TINY_MODEL_NAME = "tiny-qwen3-v2"  # v2: ChatML special tokens and a chat template
TINY_MODEL_SERVED_NAME = "l3worker-tiny"  # what the worker and the server call it
_SEED = 20240601
_NUM_BYTES = 256
_EOS_ID = 256  # <|endoftext|>, also bos
_EOS_TOKEN = "<|endoftext|>"
_VOCAB_SIZE = 320  # 256 bytes + <|endoftext|> + chat tokens + padding ids
# Chat tokens take unused ids after <|endoftext|>, as Qwen3's do after its vocabulary. Their embedding
# rows stay zero (like every padding row), so the weights are unchanged and the model never samples them.
_CHAT_TOKENS = (("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False), ("</think>", False))
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# A ChatML template of Qwen3's shape: system/user/assistant/tool turns framed by <|im_start|> and <|im_end|>,
# tools listed in the system turn, reasoning kept only for the turns after the last user query, and
# `enable_thinking=False` opening the assistant turn with an empty think block.
CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages and messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
{% elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
<|im_start|>assistant
{% if loop.index0 > ns.last_query and reasoning %}
<think>
{{ reasoning }}
</think>

{% endif %}
{{ content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{% if loop.first and content %}

{% elif not loop.first %}

{% endif %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user
{%- endif %}

<tool_response>
{{ content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
<|im_end|>
{% endif %}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endif %}
"""


def tiny_model_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # deliberately != hidden_size / num_heads
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "eos_token_id": _EOS_ID,
        "bos_token_id": _EOS_ID,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
    }


def _byte_chars() -> list[str]:
    """Printable stand-in char for each byte value (the GPT-2 ByteLevel scheme)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars: list[str] = []
    extra = 0
    for b in range(_NUM_BYTES):
        if b in printable:
            chars.append(chr(b))
        else:  # non-printable bytes are shifted past 255
            chars.append(chr(_NUM_BYTES + extra))
            extra += 1
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    return chars


def _build_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_byte_chars())}  # id i == byte i
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(_EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(_EOS_TOKEN) == _EOS_ID
    for i, (content, special) in enumerate(_CHAT_TOKENS):
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        assert tok.token_to_id(content) == _EOS_ID + 1 + i
    return tok


def tiny_tokenizer_config() -> dict[str, Any]:
    """What transformers and the server read next to tokenizer.json: special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": _EOS_TOKEN,
        "pad_token": _EOS_TOKEN,
        "unk_token": None,
        "model_max_length": tiny_model_config()["max_position_embeddings"],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


# Embedding scale sets the logit scale (std ~ 0.25 * sqrt(64) = 2: peaked enough for
# robust greedy argmax, flat enough that sampling varies). The residual-writing
# projections are 20x the embedding scale so the layers dominate the residual
# stream; otherwise the tied head just echoes the current token forever.
_EMBED_STD = 0.25
_RESIDUAL_GAIN = 20.0 * _EMBED_STD
_RESIDUAL_OUT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _init_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(cfg).items():  # fixed order -> fixed RNG stream
        if len(shape) == 1:
            arr = np.ones(shape, dtype=np.float32)  # norm weights
        elif name == "model.embed_tokens.weight":
            arr = rng.normal(0.0, _EMBED_STD, size=shape).astype(np.float32)
            # Zero the unused padding rows so the tied head never picks an
            # undecodable id (their logits are 0; the max over real tokens is > 0).
            arr[_EOS_ID + 1 :] = 0.0
        else:
            gain = _RESIDUAL_GAIN if name.endswith(_RESIDUAL_OUT) else 1.0
            arr = rng.normal(0.0, gain / np.sqrt(shape[1]), size=shape).astype(np.float32)
        weights[name] = torch.from_numpy(arr)
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", tiny_model_config())
    _write_json(out / "generation_config.json", {"bos_token_id": _EOS_ID, "eos_token_id": _EOS_ID})
    cfg = load_config(out)  # also proves the config parses
    save_file(_init_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    _build_tokenizer().save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", tiny_tokenizer_config())
    return out


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _FILES)


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Return the cached tiny model dir, creating it atomically on first use."""
    if cache_dir is None:
        cache_dir = os.environ.get("L3WORKER_CACHE") or Path.home() / ".cache" / "l3worker"
    cache = Path(cache_dir)
    target = cache / TINY_MODEL_NAME
    if _is_complete(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build in a private temp dir, then rename into place in one step so a
    # concurrent reader never sees a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}.", dir=cache))
    try:
        write_tiny_model(tmp)
        if target.exists() and not _is_complete(target):
            # Leftover from an interrupted/tampered cache: move it aside, then drop it.
            stale = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}.stale.", dir=cache))
            try:
                os.replace(target, stale / "old")
            except OSError:
                pass  # someone else already dealt with it
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)  # fails if target exists (another process won)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
