"""Random bf16 Qwen3 checkpoints of shapes of our own, for the served side-by-side against the
peers (scripts/bench_served_peers.sh, which reads PEERS_BUILD/ck-<name>):

    python scripts/make_shape_ckpt.py ../peers-build/ck-gqa8v152k gqa8v152k

Each has a byte-level BPE tokenizer that every engine loads (llama.cpp's converter included): the
256 byte symbols, one merge (llama.cpp refuses a BPE vocabulary without merges), ChatML specials,
and padding entries up to the vocabulary size. The padding entries are ordinary vocabulary entries,
not added tokens: 150k added tokens would make every tokenizer scan them, and the grammar compiler's
token trie does not build in minutes with them (docs/design/grammar.md).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


SHAPES = {
    # GQA 8:1 and Qwen3's 151,936-token vocabulary: 101M parameters, 78% of them in the tied lm_head
    "gqa8v152k": Shape(512, 8, 8, 1, 64, 1536, 151_936),
}


def tokenizer_for(vocab: int) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    entries = {symbol: i for i, symbol in enumerate(alphabet)}
    entries["ĠĠ"] = len(entries)
    for i, special in enumerate(SPECIALS):  # in the model's vocabulary too, at fixed ids
        entries[special] = len(alphabet) + 1 + i
    entries.update({f"<pad{i}>": i for i in range(len(entries), vocab)})
    tok = Tokenizer(models.BPE(vocab=entries, merges=[("Ġ", "Ġ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def write(out: Path, shape: Shape, seed: int = 0) -> int:
    """Writes the checkpoint; returns its parameter count."""
    torch.manual_seed(seed)
    end_of_turn = len(pre_tokenizers.ByteLevel.alphabet()) + 3  # <|im_end|>
    config = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=end_of_turn, bos_token_id=end_of_turn - 2,
                         torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(config).eval().to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_for(shape.vocab).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = write(args.out, SHAPES[args.shape], args.seed)
    print(f"{args.out}: {args.shape}, {params / 1e6:.0f}M parameters, {SHAPES[args.shape]}")


if __name__ == "__main__":
    main()
