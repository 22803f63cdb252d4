"""scripts/make_shape_ckpt.py: checkpoints of our own shapes for the served side-by-side. Their
tokenizer must keep the padding out of the added tokens, and l3worker must serve what it writes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_shape_ckpt.py"
sys.path.insert(0, str(SCRIPT.parent))

from make_shape_ckpt import SHAPES, SPECIALS, Shape, tokenizer_for, write  # noqa: E402


def test_padding_is_ordinary_vocabulary_and_text_round_trips() -> None:
    tok = tokenizer_for(1000)
    assert tok.get_vocab_size() == 1000
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    assert added == set(SPECIALS)  # 997 - 260 padding entries, none of them added tokens
    assert tok.token_to_id("<pad999>") == 999 and tok.token_to_id("<pad260>") == 260
    text = "héllo  wörld\n<|im_end|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>").ids == [259]


def test_the_named_shape_is_qwen3s_vocabulary_with_gqa_8_to_1() -> None:
    shape = SHAPES["gqa8v152k"]
    assert shape.vocab == 151_936 and shape.heads == 8 * shape.kv_heads


def test_l3worker_generates_from_a_written_checkpoint(tmp_path: Path) -> None:
    from l3worker import DistributedWorker, SamplingParams

    write(tmp_path, Shape(hidden=64, layers=2, heads=8, kv_heads=1, head_dim=16, intermediate=96, vocab=600))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["eos_token_id"]) == (8, 1, 259)
    with DistributedWorker(str(tmp_path), device="cpu", max_batch_size=1, max_seq_len=64, num_threads=1) as worker:
        out = worker.generate(["a shape of our own"], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                    ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
