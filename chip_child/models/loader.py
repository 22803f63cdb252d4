"""Loading of Hugging Face checkpoints: config, weights and tokenizer.

One model (chip_child.models.qwen3) serves every supported architecture: the families differ only in
configuration (FAMILIES: q/k/v and o biases, q/k norm, the head_dim default) and RoPE scaling
(chip_child.models.rope). Anything else (another architecture, sliding-window attention, an activation
other than silu, a quantization not implemented) is rejected up front by name rather than
producing silently wrong outputs later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from chip_child.models.fp8 import SCALE_SUFFIX, dequantize_blocks, is_quantized_at_load, quantize_blocks, round_trip
from chip_child.models.moe import MoeConfig, expert_tensor_shapes, parse_moe
from chip_child.models.quant import BlockFp8, parse_quantization, requested_quantization
from chip_child.models.rope import RopeScaling, parse_rope

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
_FP8_STORAGE = "F8_E4M3"
_DEFAULT_ROPE_THETA = 10000.0
_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # transformers' default when nothing is given


@dataclass(frozen=True)
class Family:
    """How an architecture differs from Qwen3. Bias flags: True / False, or None for "as the
    config's `attention_bias` says"."""

    model_types: tuple[str, ...]  # config.json model_type values accepted without 'architectures'
    qk_norm: bool
    qkv_bias: bool | None
    o_bias: bool | None
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    moe: bool = False  # sparse MLP layers (chip_child.models.moe)


FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family(("qwen3",), qk_norm=True, qkv_bias=None, o_bias=None, default_head_dim=128),
    "Qwen3MoeForCausalLM": Family(("qwen3_moe",), qk_norm=True, qkv_bias=None, o_bias=None, default_head_dim=128,
                                  moe=True),
    "Qwen2ForCausalLM": Family(("qwen2",), qk_norm=False, qkv_bias=True, o_bias=False, default_head_dim=None),
    "LlamaForCausalLM": Family(("llama",), qk_norm=False, qkv_bias=None, o_bias=None, default_head_dim=None),
    "MistralForCausalLM": Family(("mistral",), qk_norm=False, qkv_bias=False, o_bias=False, default_head_dim=None),
}


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
    qkv_bias: bool  # q_proj, k_proj and v_proj carry biases
    o_bias: bool  # o_proj carries a bias
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype: "float32" | "bfloat16" | "float16"
    eos_token_ids: tuple[int, ...]  # config.json then generation_config.json, deduplicated
    architecture: str = "Qwen3ForCausalLM"  # a key of FAMILIES
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None
    quantization: BlockFp8 | None = None  # stored, or made at load (at_load); None: plain floats
    moe: MoeConfig | None = None  # Qwen3-MoE's experts; None: every MLP dense


def projection_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each dense projection of a layer, q/k/v/o and gate/up/down, in the whole
    (unsharded) model: what a LoRA adapter's A and B must match."""
    hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q": (hidden, cfg.num_heads * hd), "k": (hidden, cfg.num_kv_heads * hd),
            "v": (hidden, cfg.num_kv_heads * hd), "o": (cfg.num_heads * hd, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}


def shard_slice(rank: int, world: int, size: int) -> slice:
    """Rank `rank`'s equal part of `size` under tensor parallelism over `world` devices."""
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _architecture(raw: dict[str, Any], path: Path) -> str:
    """The FAMILIES key this config names; ValueError naming what it names otherwise."""
    archs = raw.get("architectures")
    if archs is not None:
        known = [a for a in archs if a in FAMILIES]
        if not known:
            _refuse_remote_code(raw, f"architectures {archs!r}", path)
            raise ValueError(f"{path}: unsupported architectures {archs!r}; supported: {', '.join(FAMILIES)}")
        return known[0]
    model_type = raw.get("model_type")
    for arch, family in FAMILIES.items():
        if model_type in family.model_types:
            return arch
    _refuse_remote_code(raw, f"model_type {model_type!r}", path)
    raise ValueError(f"{path}: unsupported model_type {model_type!r} (no 'architectures'); "
                     f"supported: {', '.join(FAMILIES)}")


def _refuse_remote_code(raw: dict[str, Any], what: str, path: Path) -> None:
    """A config whose `auto_map` points at the repository's own Python (trust_remote_code in
    transformers and vLLM) names a model no built-in family implements: say so by name."""
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        raise ValueError(f"{path}: {what} needs the checkpoint's own code (auto_map: "
                         f"{', '.join(f'{k} -> {v}' for k, v in auto_map.items())}), which l3worker never runs, "
                         f"--trust-remote-code or not; supported: {', '.join(FAMILIES)}")


def _max_positions(raw: dict[str, Any], arch: str, path: Path) -> int:
    """max_position_embeddings, capped at a sliding window that would apply (sliding-window
    attention is not implemented: within the window it is exactly full attention)."""
    limit = int(raw.get("max_position_embeddings", 32768))
    window = raw.get("sliding_window")
    # Qwen2/Qwen3 configs carry a window that applies only under use_sliding_window.
    applies = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if applies and arch != "MistralForCausalLM":
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    if applies and window is not None:
        limit = min(limit, int(window))
    return limit


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


def load_config(model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
    """The checkpoint's config; `quantization`: a method to apply at load (chip_child.models.quant.requested_quantization)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found: {path}")
    raw = _read_json(path)
    arch = _architecture(raw, path)
    family = FAMILIES[arch]
    quantization = requested_quantization(quantization, parse_quantization(raw, path), path)
    max_positions = _max_positions(raw, arch, path)
    # transformers 5 also lists per-layer attention kinds; only full attention is implemented.
    odd_layers = {t for t in raw.get("layer_types") or [] if t != "full_attention"}
    if odd_layers:
        raise ValueError(f"{path}: unsupported layer_types {sorted(odd_layers)}")
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{path}: unsupported hidden_act {act!r}; only silu (SwiGLU) is supported")
    if raw.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias=true is not supported")
    rope_theta, rope_scaling = parse_rope(raw, path, _DEFAULT_ROPE_THETA)

    num_heads = int(_require(raw, "num_attention_heads", path))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    hidden_size = int(_require(raw, "hidden_size", path))
    # Qwen3Config defaults head_dim to 128 (and its model uses it); the others to hidden / heads.
    head_dim = int(raw.get("head_dim") or family.default_head_dim or hidden_size // num_heads)
    attention_bias = bool(raw.get("attention_bias", False))

    # transformers 5 saves "dtype"; older checkpoints use "torch_dtype".
    dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype_name not in _CHECKPOINT_DTYPES:
        raise ValueError(f"{path}: unsupported dtype {dtype_name!r}; expected one of {_CHECKPOINT_DTYPES}")

    eos = _as_id_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += _as_id_list(_read_json(gen_path).get("eos_token_id"))

    num_layers = int(_require(raw, "num_hidden_layers", path))
    return ModelConfig(
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden_size,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=attention_bias if family.o_bias is None else family.o_bias,
        max_position_embeddings=max_positions,
        torch_dtype=dtype_name,
        eos_token_ids=tuple(dict.fromkeys(eos)),  # union, first occurrence order
        architecture=arch,
        qk_norm=family.qk_norm,
        rope_scaling=rope_scaling,
        quantization=quantization,
        moe=parse_moe(raw, num_layers, path) if family.moe else None,
    )


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes, in a stable order."""
    V, H, I = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        proj_out = {"q_proj": (q_dim, H), "k_proj": (kv_dim, H), "v_proj": (kv_dim, H), "o_proj": (H, q_dim)}
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, shape in proj_out.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if cfg.o_bias if name == "o_proj" else cfg.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.moe is not None and i in cfg.moe.sparse_layers:
            shapes.update(expert_tensor_shapes(p + "mlp.", cfg.moe, H))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def unit_of(name: str) -> str:
    """What an HF tensor is loaded with in place (a weight update): "layer 3", or its own name."""
    m = _LAYER.match(name)
    return f"layer {m.group(1)}" if m else name


def _tensor_files(model_dir: Path, names: list[str], optional: list[str] = ()) -> dict[str, list[str]]:
    """Map each safetensors file to the expected tensor names it should hold, and to those of
    the `optional` names the index places in it (a single file gets them all: the reader skips
    what it lacks)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return {single.name: [*names, *optional]}
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
    for name in optional:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    return by_file


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    keep_fp8: bool = False,
    only: "set[str] | None" = None,
) -> dict[str, torch.Tensor]:
    """Load exactly the expected tensors (extras such as a tied lm_head are ignored) in `dtype`;
    block-FP8 weights of a checkpoint that declares them are dequantized (chip_child.models.fp8), and a
    plain checkpoint's projections quantized first when `cfg.quantization.at_load`. With
    `keep_fp8` (chip_child.models.fp8_linear.keeps_fp8: cuda) the projections (the experts' too) stay float8
    instead, each with its scales under `name + "_scale_inv"`, after the expected tensors. `only`:
    just these of the expected names (a weight update loads one layer at a time)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    expected = expected_tensor_shapes(cfg)
    if only is not None:
        expected = {name: shape for name, shape in expected.items() if name in only}
    quant = cfg.quantization
    stored = quant if quant is not None and not quant.at_load else None  # the checkpoint holds fp8 data
    scale_names = {n + SCALE_SUFFIX: n for n in expected} if stored is not None else {}
    loaded: dict[str, torch.Tensor] = {}
    fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}  # float8 projections and their scales, as stored or quantized here
    for file_name, names in _tensor_files(model_dir, list(expected), list(scale_names)).items():
        path = model_dir / file_name
        if not path.is_file():
            raise FileNotFoundError(f"safetensors shard not found: {path}")
        with safe_open(str(path), framework="pt") as f:  # memory-mapped
            available = set(f.keys())
            for name in names:
                if name in scale_names:
                    if name in available:
                        scales[scale_names[name]] = f.get_tensor(name)
                    continue
                if name not in available:
                    raise ValueError(f"missing tensor {name!r} in {path}")
                # Check the shape from the header before materialising the data.
                found = tuple(f.get_slice(name).get_shape())
                if found != expected[name]:
                    raise ValueError(
                        f"tensor {name!r} in {path} has shape {list(found)}, "
                        f"expected {list(expected[name])}"
                    )
                storage = f.get_slice(name).get_dtype()
                if storage == _FP8_STORAGE and stored is not None:
                    fp8[name] = f.get_tensor(name)
                    continue
                if storage not in _FLOAT_STORAGE:
                    declared = "does not declare" if stored is None else f"declares as {stored.quant_method}, which stores {_FP8_STORAGE}"
                    raise ValueError(
                        f"tensor {name!r} in {path} is stored as {storage}, a quantized format that "
                        f"{model_dir / 'config.json'} {declared}; refusing to load it as a plain weight"
                    )
                if quant is not None and quant.at_load and is_quantized_at_load(name):
                    if keep_fp8:
                        kept[name], kept[name + SCALE_SUFFIX] = quantize_blocks(f.get_tensor(name), quant.block)
                        continue
                    loaded[name] = round_trip(f.get_tensor(name), quant.block, dtype).to(device)
                    continue
                loaded[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    for name in list(fp8):
        if name not in scales:
            raise ValueError(f"block fp8 tensor {name!r} has no {name + SCALE_SUFFIX!r} in {model_dir}")
        if keep_fp8:
            kept[name], kept[name + SCALE_SUFFIX] = fp8.pop(name), scales.pop(name)
            continue
        loaded[name] = dequantize_blocks(fp8.pop(name), scales.pop(name), stored.block, dtype).to(device)
    loaded.update({name: t.to(device) for name, t in kept.items()})
    # Keep the canonical order regardless of shard layout; kept scales after.
    return {name: loaded[name] for name in [*expected, *(n for n in kept if n.endswith(SCALE_SUFFIX))]}


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
