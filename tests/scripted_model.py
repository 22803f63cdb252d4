"""A Qwen3 checkpoint whose greedy output is a known text: a bigram model over a tokenizer whose
added tokens are whole pieces of the replies, so that each reply is a chain of distinct tokens.

Every attention o_proj and MLP down_proj is zero, so the final hidden state is the current token's
embedding; embeddings are random (nearly orthogonal at hidden 128) and the untied lm_head's row for
next(t) is SCALE * embed[t] / |embed[t]|, so greedy decoding writes next(t) after t. The last
prompt token picks the chain:

- "\\n" (the chat template's assistant opening, thinking on): REPLY_TOOL, reasoning then a hermes
  tool call;
- "</think>\\n\\n" (the end of an `enable_thinking: false` prompt): REPLY_NO_THINK, an answer;
- "<think>\\n" (a template that opens the think block in the prompt, THINK_OPEN_TEMPLATE):
  REPLY_OPENED, the rest of the reasoning, `</think>` and an answer;
- "Q": the byte 0xE5 (a partial UTF-8 character, as 0xE4 is: both read as U+FFFD), for top_logprobs.

Each chain ends with <|im_end|>, the eos. The chat template is the built-in tiny model's (Qwen3's
shape: tools in the system turn, tool results as <tool_response> in a user turn, enable_thinking).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from chip_child.models.loader import expected_tensor_shapes, load_config
from chip_child.models.tiny_model import CHAT_TEMPLATE, _build_tokenizer

EOS_TOKEN = "<|im_end|>"
CALL_ARGUMENTS = '{"city": "Paris"}'
CALL = '{"name": "get_weather", "arguments": ' + CALL_ARGUMENTS + '}'

# Chains of token texts; each chain's tokens are distinct from every other chain's.
TOOL_CHAIN = ("<think>", "\nThe user wants the weather in Paris.\n", "</think>", "\n\n", "<tool_call>",
              "\n" + CALL + "\n", "</tool_call>")
NO_THINK_CHAIN = ("It is sunny in Paris.",)
OPENED_CHAIN = ("The tool said it is sunny", ".\n</think>\n\n", "Sunny, 22 degrees.")
REPLY_TOOL = "".join(TOOL_CHAIN)
REPLY_NO_THINK = "".join(NO_THINK_CHAIN)
REPLY_OPENED = "".join(OPENED_CHAIN)
REASONING = "\nThe user wants the weather in Paris.\n"  # what REPLY_TOOL thinks

NO_THINK_END = "</think>\n\n"
THINK_OPEN = "<think>\n"
PROBE, PROBE_NEXT, PROBE_TWIN = "Q", 0xE5, 0xE4  # after "Q" the model writes byte 0xE5; 0xE4 reads alike

# The tiny template with the generation prompt opening the think block (as some reasoning models' do).
THINK_OPEN_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if enable_thinking is defined and enable_thinking is false %}",
    "<think>\n{% if false %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

VOCAB_SIZE = 320
HIDDEN = 128
SCALE = 2.0  # the chain token's logit is SCALE * sqrt(HIDDEN), ~22.6; any other stays below ~8
_SEED = 7


def build_tokenizer() -> Tokenizer:
    """The tiny model's byte-level tokenizer (bytes, <|endoftext|>, <|im_start|>, <|im_end|>, <think>,
    </think>) plus the pieces of the chains and the prompt endings, as non-special added tokens."""
    tok = _build_tokenizer()
    pieces = {t for chain in (TOOL_CHAIN, NO_THINK_CHAIN, OPENED_CHAIN) for t in chain}
    pieces |= {NO_THINK_END, THINK_OPEN}
    for piece in sorted(pieces):
        if tok.token_to_id(piece) is None and len(piece.encode()) > 1:
            tok.add_tokens([AddedToken(piece, special=False, normalized=False)])
    assert tok.get_vocab_size() <= VOCAB_SIZE
    return tok


def _ids(tok: Tokenizer, texts: tuple[str, ...]) -> list[int]:
    ids = []
    for t in texts:
        i = tok.token_to_id(t)
        ids.append(i if i is not None and len(t.encode()) > 1 else t.encode()[0])
    return ids


def transitions(tok: Tokenizer) -> dict[int, int]:
    """next(t) for every token that starts or continues a chain."""
    eos = tok.token_to_id(EOS_TOKEN)
    step: dict[int, int] = {}
    for start, chain in (("\n", TOOL_CHAIN), (NO_THINK_END, NO_THINK_CHAIN), (THINK_OPEN, OPENED_CHAIN)):
        ids = _ids(tok, (start, *chain)) + [eos]
        for a, b in zip(ids, ids[1:]):
            assert a not in step, f"token {a} would start two chains"
            step[a] = b
    step[ord(PROBE)] = PROBE_NEXT
    return step


def config(eos: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 2048,
        "torch_dtype": "float32", "eos_token_id": eos, "bos_token_id": None, "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False,
    }


def write_scripted_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    eos = tok.token_to_id(EOS_TOKEN)
    (out / "config.json").write_text(json.dumps(config(eos), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 2048, "chat_template": CHAT_TEMPLATE}, indent=2))
    cfg = load_config(out)
    rng = np.random.default_rng(_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(cfg).items():
        if len(shape) == 1:
            arr = np.ones(shape, np.float32)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            arr = np.zeros(shape, np.float32)  # no layer writes to the residual stream
        else:
            arr = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), size=shape).astype(np.float32)
        weights[name] = torch.from_numpy(arr)
    embed = weights["model.embed_tokens.weight"].numpy()
    head = rng.normal(0.0, 0.01, size=embed.shape).astype(np.float32)
    for src, dst in transitions(tok).items():
        head[dst] = 0.0
    for src, dst in transitions(tok).items():  # a token that ends several chains (eos) sums their rows
        head[dst] += SCALE * embed[src] / np.linalg.norm(embed[src])
    weights["lm_head.weight"] = torch.from_numpy(head)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
