"""Loading of Hugging Face Qwen3 checkpoints: config, weights and tokenizer.

Only Qwen3ForCausalLM with default (unscaled) RoPE and full attention is
supported; anything else is rejected up front with a clear error rather than
producing silently wrong outputs later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from chip_child.quant import check_quantization

SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_ACCELERATORS = ("cuda", "npu")
# safetensors dtype names of plain float weights; anything else (float8, int8, packed int4 in
# int32) is quantized data that only a declared and implemented quantization may read.
_FLOAT_STORAGE = ("F32", "BF16", "F16")
_DEFAULT_ROPE_THETA = 10000.0  # transformers' Qwen3 default when nothing is given


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (defaults to num_heads)
    head_dim: int  # may differ from hidden_size // num_heads
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype: "float32" | "bfloat16" | "float16"
    eos_token_ids: tuple[int, ...]  # config.json then generation_config.json, deduplicated


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _check_architecture(raw: dict[str, Any], path: Path) -> None:
    archs = raw.get("architectures")
    if archs is not None:
        if SUPPORTED_ARCHITECTURE not in archs:
            raise ValueError(
                f"{path}: unsupported architectures {archs!r}; "
                f"only {SUPPORTED_ARCHITECTURE} is supported"
            )
    elif raw.get("model_type") != "qwen3":
        raise ValueError(
            f"{path}: unsupported model_type {raw.get('model_type')!r} (no 'architectures'); "
            f"only {SUPPORTED_ARCHITECTURE} is supported"
        )


def _rope_theta(raw: dict[str, Any], path: Path) -> float:
    """Find rope_theta in any of the three places configs put it; reject scaled RoPE."""
    theta = raw.get("rope_theta")
    # transformers 5 writes "rope_parameters"; older configs use "rope_scaling" (often null).
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{path}: '{key}' must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"{path}: unsupported {key} rope type {rope_type!r}; only 'default' RoPE is supported"
            )
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    return float(theta) if theta is not None else _DEFAULT_ROPE_THETA


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _require(raw: dict[str, Any], key: str, path: Path) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"{path}: missing required field '{key}'")
    return raw[key]


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found: {path}")
    raw = _read_json(path)
    _check_architecture(raw, path)
    check_quantization(raw, path)

    if raw.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    # transformers 5 also lists per-layer attention kinds; only full attention is implemented.
    odd_layers = {t for t in raw.get("layer_types") or [] if t != "full_attention"}
    if odd_layers:
        raise ValueError(f"{path}: unsupported layer_types {sorted(odd_layers)}")
    rope_theta = _rope_theta(raw, path)

    num_heads = int(_require(raw, "num_attention_heads", path))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    hidden_size = int(_require(raw, "hidden_size", path))
    head_dim = int(raw.get("head_dim") or 128)  # transformers' Qwen3Config default, which its model uses

    # transformers 5 saves "dtype"; older checkpoints use "torch_dtype".
    dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype_name not in _CHECKPOINT_DTYPES:
        raise ValueError(f"{path}: unsupported dtype {dtype_name!r}; expected one of {_CHECKPOINT_DTYPES}")

    eos = _as_id_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += _as_id_list(_read_json(gen_path).get("eos_token_id"))

    return ModelConfig(
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden_size,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=int(_require(raw, "num_hidden_layers", path)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        torch_dtype=dtype_name,
        eos_token_ids=tuple(dict.fromkeys(eos)),  # union, first occurrence order
    )


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes for Qwen3ForCausalLM, in a stable order."""
    V, H, I = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        proj_out = {"q_proj": (q_dim, H), "k_proj": (kv_dim, H), "v_proj": (kv_dim, H), "o_proj": (H, q_dim)}
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, shape in proj_out.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _tensor_files(model_dir: Path, names: list[str]) -> dict[str, list[str]]:
    """Map each safetensors file to the expected tensor names it should hold."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return {single.name: names}
    if not index.is_file():
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}"
        )
    weight_map: dict[str, str] = _read_json(index).get("weight_map") or {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in weight_map:
            raise ValueError(f"missing tensor {name!r}: not in weight_map of {index}")
        by_file.setdefault(weight_map[name], []).append(name)
    return by_file


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load exactly the expected tensors (extras such as a tied lm_head are ignored)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    expected = expected_tensor_shapes(cfg)
    loaded: dict[str, torch.Tensor] = {}
    for file_name, names in _tensor_files(model_dir, list(expected)).items():
        path = model_dir / file_name
        if not path.is_file():
            raise FileNotFoundError(f"safetensors shard not found: {path}")
        with safe_open(str(path), framework="pt") as f:  # memory-mapped
            available = set(f.keys())
            for name in names:
                if name not in available:
                    raise ValueError(f"missing tensor {name!r} in {path}")
                # Check the shape from the header before materialising the data.
                found = tuple(f.get_slice(name).get_shape())
                if found != expected[name]:
                    raise ValueError(
                        f"tensor {name!r} in {path} has shape {list(found)}, "
                        f"expected {list(expected[name])}"
                    )
                stored = f.get_slice(name).get_dtype()
                if stored not in _FLOAT_STORAGE:
                    raise ValueError(
                        f"tensor {name!r} in {path} is stored as {stored}, a quantized format that "
                        f"{model_dir / 'config.json'} does not declare; refusing to load it as a plain weight"
                    )
                loaded[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    # Keep the canonical order regardless of shard layout.
    return {name: loaded[name] for name in expected}


def load_tokenizer(model_dir: str | Path) -> tokenizers.Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path)) if path.is_file() else None


def resolve_dtype(name: str, device_type: str, cfg: ModelConfig) -> torch.dtype:
    """Map a user dtype name to torch; "auto" keeps the checkpoint dtype except on CPU."""
    key = name.strip().lower()
    if key == "auto":
        if device_type in _ACCELERATORS:
            return _DTYPE_ALIASES[cfg.torch_dtype]
        return torch.float32  # CPU half-precision matmuls are slow and imprecise
    if key not in _DTYPE_ALIASES:
        accepted = ", ".join(["auto", *_DTYPE_ALIASES])
        raise ValueError(f"invalid dtype {name!r}; accepted values for field 'dtype': {accepted}")
    return _DTYPE_ALIASES[key]
