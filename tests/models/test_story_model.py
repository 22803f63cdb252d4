"""The built-in story model the example runs: it ships complete, loads as transformers loads it
(greedy tokens and fp32 logits agree), and writes the words of the stories it was trained on."""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from chip_child.models.loader import load_tokenizer
from chip_child.local import LocalDriver, LocalRequest
from chip_child.step.runtime import ChipRuntime, RuntimeConfig
from chip_child.models.story_model import story_model_dir
from l3worker import DistributedWorker, SamplingParams
from parity import assert_matches_transformers

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
OPENINGS = ["Once upon a time", "One day, a little fox named Max", "Lily was a shy bird who", "But one day, Tom"]


def story_words() -> set[str]:
    """Every word the training grammar can write (from the training script's own generator)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from train_story_model import story
    finally:
        sys.path.remove(str(SCRIPTS))
    rng = random.Random(0)
    return {w for _ in range(3000) for w in re.findall(r"[A-Za-z]+", story(rng))}


def test_greedy_tokens_and_logits_match_transformers() -> None:
    tokenizer = load_tokenizer(story_model_dir())
    prompts = [tokenizer.encode(t).ids for t in OPENINGS]
    rt = ChipRuntime(RuntimeConfig(str(story_model_dir()), device="cpu", dtype="float32", max_batch_size=4,
                                   max_seq_len=128, page_size=16))
    try:
        res = LocalDriver(rt).run([LocalRequest(p, 12) for p in prompts], keep_logits=True)
    finally:
        rt.close()
    model = AutoModelForCausalLM.from_pretrained(story_model_dir(), torch_dtype=torch.float32).eval()
    assert_matches_transformers(model, prompts, res.token_ids, res.logits, new_tokens=12)


def test_it_writes_the_words_of_its_stories() -> None:
    known = story_words()
    with DistributedWorker(story_model_dir(), max_batch_size=4, max_seq_len=256, page_size=16) as w:
        texts = [o.text for o in w.generate(OPENINGS, SamplingParams(temperature=0.0, max_new_tokens=40))]
    words = [w for t in texts for w in re.findall(r"[A-Za-z]+", t)]
    assert len(words) >= 4 * 10, texts  # sentences, not a few stray tokens
    unknown = [w for w in words if w not in known]
    assert len(unknown) <= len(words) // 20, (unknown, texts)
