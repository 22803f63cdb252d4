"""EAGLE-3 speculation: a random head in the public Qwen3 heads' format (config keys and tensor
names as published) gives the plain tokens, greedy and seeded, at pipeline depths 1 and 2 and
under preemption, and under tensor parallelism (two ranks on one node, and across two nodes);
counts add up; a head that does not fit the target is refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chip_child.spec.eagle3 import aux_layers
from l3worker import DistributedWorker, SamplingParams
from spec_helpers import PARAMS, PROMPTS, SMALL, _check_counts, _tokens

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from bench_models import write_random_eagle3_head  # noqa: E402  (scripts/: the benchmarks use it too)


def write_head(path: Path, hidden: int = 64, aux: list[int] | None = None) -> Path:
    """A random head for the built-in tiny Qwen3 (hidden 64, vocab 320, 2 layers)."""
    return write_random_eagle3_head(path, hidden=hidden, vocab=320, draft_vocab=64, aux=aux)


def _eagle(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@pytest.mark.parametrize("options, aux", [
    ({}, None),  # run-ahead (pipeline_depth 2); vLLM's default layers
    ({"pipeline_depth": 1}, [0, 1, 1]),
    ({"max_num_batched_tokens": 8}, None),  # prompts prefilled in chunks beside speculating rows
    ({"num_pages": 14, "enable_prefix_caching": False}, None),  # rows preempted and resumed
], ids=["depth2", "depth1", "chunked", "preempted"])
def test_eagle3_tokens_identical_to_plain_decoding(plain, tmp_path, options, aux) -> None:
    head = write_head(tmp_path / "head", aux=aux)
    with DistributedWorker(**SMALL, speculative_config=_eagle(head), **options) as w:
        for _ in range(2):  # the second call: prefix-cache hits where on, and rows the head saw before
            assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        s = _check_counts(w)
        assert s["num_drafts"] > 0 and s["num_draft_tokens"] > 0
        if "num_pages" in options:
            assert w.engine.scheduler.num_preemptions > 0
        stats = w.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_aux_layers_from_the_config_else_vllms_default() -> None:
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}, 36) == (1, 17, 32)
    assert aux_layers({}, 36) == (2, 18, 33)
    assert aux_layers({}, 2) == (1, 1, 0)  # clamped into a shallow target
    with pytest.raises(ValueError, match="must be 3 layers of the target's 36"):
        aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 40, 3]}}, 36)


@pytest.mark.parametrize("change, message", [
    ({"hidden": 32}, "hidden_size 32 differs from the target's 64"),
    ({"aux": [0, 1, 2]}, "must be 3 layers of the target's 2"),
])
def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path, change, message) -> None:
    head = write_head(tmp_path / "head", **change)
    with pytest.raises(ValueError, match=message):
        DistributedWorker(**SMALL, speculative_config=_eagle(head))


@pytest.mark.parametrize("key", ["norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias"])
def test_a_head_with_a_layer_variant_it_does_not_implement_is_refused_by_name(tmp_path, key) -> None:
    head = write_head(tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, key: True}))
    with pytest.raises(ValueError, match=f"the EAGLE-3 head sets {key}"):
        DistributedWorker(**SMALL, speculative_config=_eagle(head))


def test_a_checkpoint_that_is_no_eagle3_head_is_refused() -> None:
    from chip_child.models.tiny_model import ensure_tiny_model

    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        DistributedWorker(**SMALL, speculative_config=_eagle(ensure_tiny_model()))


def test_a_head_whose_d2t_leaves_the_target_vocabulary_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    head = write_head(tmp_path / "head")
    tensors = load_file(str(head / "model.safetensors"))
    tensors["d2t"][-1] = 320  # the last draft id would map past the target's 320 ids
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's 320 ids"):
        DistributedWorker(**SMALL, speculative_config=_eagle(head))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict:
    """eagle3's counters after one call of the workload on one device (the default random head)."""
    head = write_head(tmp_path_factory.mktemp("one-device") / "head")
    with DistributedWorker(**SMALL, speculative_config=_eagle(head)) as w:
        w.generate(PROMPTS, PARAMS)
        return w.stats()["speculative"]


# Rank 0's head reads the hidden states one device has (up to the all-reduce's order of summation),
# so it proposes, and the ranks accept, what one device does: the counters agree.
@pytest.mark.parametrize("options", [{}, {"pipeline_depth": 1}], ids=["depth2", "depth1"])
def test_eagle3_under_tensor_parallel_gives_the_plain_tokens(plain, one_device, tmp_path, options) -> None:
    """Two ranks on this node (gloo): rank 0's head drafts, both ranks verify its drafts."""
    head = write_head(tmp_path / "head")
    with DistributedWorker(**SMALL, device_ids=(0, 1), speculative_config=_eagle(head), **options) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        assert _check_counts(w) == one_device
        assert one_device["num_drafts"] > 0 and one_device["num_draft_tokens"] > 0
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain  # rows the head saw before, prefix-cache hits


def test_eagle3_under_tensor_parallel_across_two_nodes(plain, one_device, tmp_path, follower) -> None:
    """One rank here and one on a follower node over the loopback: the follower's rank only
    receives drafts, so the head's directory is read on this node alone."""
    from chip_child.models.tiny_model import ensure_tiny_model
    from l3worker.distributed.nodes import free_master_port

    head = write_head(tmp_path / "head")
    port = free_master_port(2)
    follower(ensure_tiny_model(), port)
    with DistributedWorker(**SMALL, tensor_parallel_size=2, nnodes=2, master_port=port, startup_timeout_s=120,
                           speculative_config=_eagle(head)) as w:
        assert _tokens(w.generate(PROMPTS, PARAMS)) == plain
        assert _check_counts(w) == one_device


def _bigram_target_and_its_mirror_head(root: Path) -> tuple[Path, Path]:
    """A Qwen3 whose layers add nothing to the residual stream (o_proj and down_proj zero), so its
    next token is a function of the current token alone, and an EAGLE-3 head that computes that
    very function: fc and the hidden-state path are zero, its attention looks at its own position
    only (q and k read a constant embedding column through RoPE's highest frequencies, at a large
    scale) and copies that position's normed token embedding to the output, whose norm and
    lm_head are the target's. Every first draft is the target's greedy token: acceptance 1."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    hidden, heads, head_dim, vocab, const = 64, 4, 16, 320, 7
    torch.manual_seed(5)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, max_position_embeddings=512,
        eos_token_id=None)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
        model.model.embed_tokens.weight[:, const] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target = root / "target"
    model.save_pretrained(target)
    state = load_file(str(target / "model.safetensors"))
    head = root / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 32, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False}))
    q, k = torch.zeros(heads * head_dim, 2 * hidden), torch.zeros(heads * head_dim, 2 * hidden)
    for h in range(heads):  # rotary dims 0 and 1 of every head: the two highest frequencies
        q[h * head_dim:h * head_dim + 2, const] = 200.0
        k[h * head_dim:h * head_dim + 2, const] = 1.0
    v = torch.zeros(heads * head_dim, 2 * hidden)
    v[:, :hidden] = torch.eye(hidden)  # the normed token embedding, unchanged
    m = "midlayer."
    save_file({
        "fc.weight": torch.zeros(hidden, 3 * hidden), "norm.weight": state["model.norm.weight"].float(),
        "lm_head.weight": state["lm_head.weight"].float(),
        m + "hidden_norm.weight": torch.zeros(hidden), m + "input_layernorm.weight": torch.ones(hidden),
        m + "post_attention_layernorm.weight": torch.ones(hidden),
        m + "self_attn.q_proj.weight": q, m + "self_attn.k_proj.weight": k, m + "self_attn.v_proj.weight": v,
        m + "self_attn.o_proj.weight": torch.eye(hidden), m + "mlp.gate_proj.weight": torch.zeros(32, hidden),
        m + "mlp.up_proj.weight": torch.zeros(32, hidden), m + "mlp.down_proj.weight": torch.zeros(hidden, 32),
    }, str(head / "model.safetensors"))
    return target, head


def test_a_head_that_mirrors_its_target_has_every_draft_accepted(tmp_path) -> None:
    target, head = _bigram_target_and_its_mirror_head(tmp_path)
    prompts = [[5, 9, 33, 2], [100, 101, 102, 103, 104, 105], [7]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    options = dict(device="cpu", max_batch_size=4, max_seq_len=64, page_size=8, dtype="float32", num_threads=1)
    with DistributedWorker(str(target), **options) as w:
        plain = [o.token_ids for o in w.generate(prompts, params)]
    assert len({t for tokens in plain for t in tokens}) > 6  # not one token over and over: drafting is real work
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 1}
    with DistributedWorker(str(target), speculative_config=spec, **options) as w:
        assert [o.token_ids for o in w.generate(prompts, params)] == plain
        s = _check_counts(w)
    # Every step of every row verifies one real draft, and the target always agrees with it.
    assert s["num_drafts"] > 0 and s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] == 2.0
