"""Random Qwen3 checkpoints and EAGLE-3 heads for the benchmarks (imported by the scripts next to
this file, and by the tests)."""
from __future__ import annotations

from pathlib import Path


def write_random_qwen3(path: Path, config: dict, seed: int = 0, family: str = "Qwen3") -> int:
    """A random {family}ForCausalLM (Qwen3 unless told, e.g. Qwen3Moe) of these {family}Config
    fields, seeded, saved with save_pretrained; returns its parameter count."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config_cls, model_cls = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")
    model = model_cls(config_cls(**config)).eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_random_eagle3_head(path: Path, hidden: int, vocab: int, draft_vocab: int, heads: int = 4, kv_heads: int = 2,
                             head_dim: int = 16, inter: int = 96, aux: list[int] | None = None, seed: int = 0) -> Path:
    """A random head in the format of the public Qwen3 EAGLE-3 heads (LlamaForCausalLMEagle3: their
    config keys and tensor names): one layer whose attention reads 2 * hidden, `fc` from three
    target hidden states, `lm_head` over a draft vocabulary mapped to target ids by `d2t` (`t2d`
    its inverse mask), no embeddings (the target's are shared). `aux`: eagle_aux_hidden_state_layer_ids."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # the target ids the head can draft
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    m = "midlayer."
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden), "d2t": kept - torch.arange(draft_vocab), "t2d": t2d,
        m + "hidden_norm.weight": torch.ones(hidden), m + "input_layernorm.weight": torch.ones(hidden),
        m + "post_attention_layernorm.weight": torch.ones(hidden),
        m + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        m + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        m + "mlp.gate_proj.weight": rand(inter, hidden), m + "mlp.up_proj.weight": rand(inter, hidden),
        m + "mlp.down_proj.weight": rand(hidden, inter),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path
