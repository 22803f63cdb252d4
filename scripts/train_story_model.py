"""Trains the built-in story model that `examples/npu_generate.py` runs when no checkpoint is given.

    python scripts/train_story_model.py                 # writes chip_child/models/story_model/ (about 10 min on 2 cores)
    python scripts/train_story_model.py --steps 50 --out /tmp/story   # a quick smoke run

The text is generated here, by a small grammar of children's stories (names, animals, places,
objects, feelings; a beginning, a problem, a helper and an ending), so nothing is downloaded and
every byte of the training data can be regenerated from the seed. A byte-level BPE tokenizer is
trained on it with `tokenizers`, then a Qwen3 of about a million parameters with transformers'
Qwen3ForCausalLM (the architecture the runtime loads). Same seed, same stories and tokenizer;
the weights match up to the order of float reductions on the machine that trains them.
Needs the test extra (transformers).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]

NAMES = ["Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Lucy", "Jack", "Emma", "Leo", "Zoe", "Tim", "Sara"]
ANIMALS = ["cat", "dog", "rabbit", "fox", "bird", "duck", "bear", "mouse", "frog", "owl", "pig", "horse"]
ADJECTIVES = ["little", "big", "happy", "brave", "small", "kind", "shy", "funny", "sleepy", "curious"]
PLACES = ["the park", "the forest", "the garden", "the beach", "the farm", "the river", "the hill", "the town",
          "the meadow", "the lake"]
OBJECTS = ["ball", "kite", "box", "hat", "book", "cake", "boat", "flower", "toy", "apple", "key", "drum"]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud", "surprised", "angry"]
PROBLEMS = ["lost the {color} {obj}", "could not find the way home", "was stuck in a tree", "fell into the water",
            "broke the {color} {obj}", "was very hungry", "heard a loud noise"]
HELPS = ["found the {color} {obj} under a bush", "showed the way home", "climbed up and helped",
         "pulled {them} out of the water", "fixed the {color} {obj} with some glue", "shared an {food}",
         "said it was only the wind"]
FOODS = ["apple", "orange", "egg", "ice cream"]
ENDINGS = ["From that day on, they were best friends.", "They laughed and played until the sun went down.",
           "Then they went home and had a big dinner.", "It was the best day ever.",
           "{name} said thank you, and they walked home together.", "Everyone was {feeling} and smiled."]


def story(rng: random.Random) -> str:
    """One short story: a hero, a problem, a helper, an ending."""
    name, friend = rng.sample(NAMES, 2)
    animal, helper = rng.sample(ANIMALS, 2)
    fill = dict(color=rng.choice(COLORS), obj=rng.choice(OBJECTS), food=rng.choice(FOODS), them="them",
                name=name, feeling=rng.choice(FEELINGS))
    adj = rng.choice(ADJECTIVES)
    article = "an" if adj[0] in "aeiou" else "a"
    opening = rng.choice([
        f"Once upon a time, there was {article} {adj} {animal} named {name}.",
        f"One day, {article} {adj} {animal} named {name} went to {rng.choice(PLACES)}.",
        f"{name} was {article} {adj} {animal} who lived near {rng.choice(PLACES)}.",
    ])
    sentences = [opening]
    if rng.random() < 0.6:
        sentences.append(f"{name} loved to play with a {fill['color']} {fill['obj']}.")
    problem = rng.choice(PROBLEMS).format(**fill)
    sentences.append(f"But one day, {name} {problem}.")
    sentences.append(f"{name} felt {rng.choice(['sad', 'scared', 'worried', 'lonely'])}.")
    sentences.append(f"Then a {rng.choice(ADJECTIVES)} {helper} named {friend} came by.")
    if rng.random() < 0.5:
        sentences.append(f'"Do not worry," said {friend}. "I will help you."')
    sentences.append(f"{friend} {rng.choice(HELPS).format(**fill)}.")
    sentences.append(f"{name} was very {rng.choice(['happy', 'glad', 'thankful', 'proud'])}.")
    sentences.append(rng.choice(ENDINGS).format(**fill))
    return " ".join(sentences)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *CHAT_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def model_config(vocab_size: int, eos_id: int, max_len: int) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
            "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": max_len,
            "torch_dtype": "bfloat16", "eos_token_id": eos_id, "bos_token_id": eos_id, "attention_bias": False,
            "attention_dropout": 0.0, "use_sliding_window": False}


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "chip_child" / "story_model")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--stories", type=int, default=40000)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    texts = [story(rng) for _ in range(args.stories)]
    tok = train_tokenizer(texts, args.vocab_size)
    eos = tok.token_to_id(EOS)
    ids = torch.tensor([t for text in texts for t in tok.encode(text).ids + [eos]], dtype=torch.long)
    cfg = model_config(tok.get_vocab_size(), eos, 4096)  # a limit only: rope needs no table
    model = Qwen3ForCausalLM(Qwen3Config(**{**cfg, "torch_dtype": "float32"}))
    params = sum(t.numel() for t in model.parameters())
    print(f"{len(texts)} stories, {len(ids)} tokens, vocab {tok.get_vocab_size()}, {params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 *
                                              (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.perf_counter()
    for step, x in zip(range(args.steps), batches(ids, args.batch, args.seq, gen)):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f}s", flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
         "add_bos_token": False, "model_max_length": cfg["max_position_embeddings"]}, indent=2) + "\n")
    model.eval()
    with torch.no_grad():
        prompt = torch.tensor([tok.encode("Once upon a time").ids])
        sample = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=eos)
    print("sample:", tok.decode(sample[0].tolist()))


if __name__ == "__main__":
    main()
