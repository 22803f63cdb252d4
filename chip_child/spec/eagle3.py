"""An EAGLE-3 head in the chip-child: one decoder layer that drafts from the target's own hidden
states, with its own paged K/V cache on the target's page ids.

The checkpoint format is that of the public Qwen3 heads (vLLM's name: `LlamaForCausalLMEagle3`):
`fc` maps the concatenation of three target hidden states (the inputs of the layers in
`eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default choice) to hidden size;
`midlayer.*` is one Llama layer whose attention reads 2 * hidden (the normed token embedding,
`input_layernorm`, beside the normed hidden state, `hidden_norm`); `norm` and `lm_head` give
logits over `draft_vocab_size` ids, mapped to target ids by `d2t` (id + d2t[id]). A head without
`embed_tokens` shares the target's embeddings.

Head position p consumes the target's hidden state at p and the token at p + 1, and predicts the
token at p + 2. After each target forward (captured only with eagle3 on) the head catches up over
the positions whose next token the step knows: a plain step's decoding lanes (next: the sample)
and prompt chunks (next: the chunk's own token, or the sample after a prompt's last), a verify
step's accepted positions (next: the target's tokens). A row's last such position yields the
first draft of its next step; drafts 2..k then feed the head's own output back (pre-norm) one
position at a time. A row the head has not caught up with gets no drafts that step. Draft
tokens never decide output tokens (verification does), so positions the head never saw (a
chunk's last when the prompt goes on, a prefix-cache hit's) cost acceptance only.

Under tensor parallelism rank 0 alone runs the (unsharded) head and broadcasts its drafts: the
hidden states it reads, the residual stream after each layer's all-reduce, are the full ones on
every rank, and one broadcast keeps every rank verifying the same drafts whatever the last bits of
its own arithmetic. The other ranks neither load the head nor read its directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from chip_child.attention import AttentionSpec, get_backend
from chip_child.models.loader import ModelConfig
from chip_child.models.qwen3 import apply_rope, rms_norm, rope_table
from chip_child.step.packed_axis import PackedAxis, packed_axis
from chip_child.models.rope import parse_rope
from chip_child.sampling.sampler import Features

if TYPE_CHECKING:
    from chip_child.step.host import StepHost

ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# Config switches of other heads' layers (norm placement, attention biases), all off in ours.
UNSUPPORTED_SWITCHES = ("norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias")
_LAYER = ("hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
          "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def aux_layers(raw: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the config's, else vLLM's default
    (2, L // 2, L - 3), clamped into the target for very shallow models."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
        ids = tuple(min(max(i, 0), target_layers - 1) for i in ids)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
        raise ValueError(f"speculative_config: eagle_aux_hidden_state_layer_ids {list(ids)} must be 3 layers of "
                         f"the target's {target_layers}")
    return ids


def head_config(model_dir: str, target: ModelConfig) -> tuple[ModelConfig, tuple[int, ...], int]:
    """(the head's layer as a ModelConfig, the target layers it reads, draft_vocab_size) from its
    config.json; ValueError naming what does not fit the target. The parent checks it before any
    child starts."""
    path = Path(model_dir)
    raw = json.loads((path / "config.json").read_text())
    if not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
        raise ValueError(f"speculative_config: {path} is not an EAGLE-3 head (architectures "
                         f"{raw.get('architectures')!r}, expected one of {ARCHITECTURES})")
    hidden = int(raw["hidden_size"])
    if hidden != target.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head's hidden_size {hidden} differs from the "
                         f"target's {target.hidden_size}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError("speculative_config: an EAGLE-3 head has num_hidden_layers 1")
    for key in UNSUPPORTED_SWITCHES:  # variants of the layer this head does not implement: refused, not ignored
        if raw.get(key) or (raw.get("eagle_config") or {}).get(key):
            raise ValueError(f"speculative_config: the EAGLE-3 head sets {key}, which l3worker's head does not "
                             "implement")
    heads = int(raw["num_attention_heads"])
    theta, scaling = parse_rope(raw, path, 10000.0)
    cfg = replace(target, vocab_size=int(raw.get("vocab_size", target.vocab_size)), num_layers=1, num_heads=heads,
                  num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                  head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
                  rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling, moe=None,
                  quantization=None)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head's vocab_size {cfg.vocab_size} differs from "
                         f"the target's {target.vocab_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
    _check_d2t(_read_tensors(path, "d2t").get("d2t"), draft_vocab, target.vocab_size)
    return cfg, aux_layers(raw, target.num_layers), draft_vocab


def _check_d2t(d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor:
    """d2t as int64 ([draft_vocab] zeros when absent and the vocabularies agree); ValueError when
    it is missing, misshapen, or sends a draft id outside the target's ids."""
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"speculative_config: draft_vocab_size {draft_vocab} differs from vocab_size {vocab}, "
                             "and the head has no d2t to map draft ids to target ids")
        return torch.zeros(draft_vocab, dtype=torch.int64)
    d2t = d2t.to(torch.int64)
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"speculative_config: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    ids = torch.arange(draft_vocab) + d2t
    if draft_vocab and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(f"speculative_config: d2t maps draft ids outside the target's {vocab} ids")
    return d2t


def _read_tensors(path: Path, only: str | None = None) -> dict[str, torch.Tensor]:
    """The head's tensors by name without a "model." prefix; `only`: just that one (if stored)."""
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            with safe_open(str(f), "pt") as sf:
                names = [k for k in sf.keys() if only is None or k.removeprefix("model.") == only]
                state.update({k: sf.get_tensor(k) for k in names})
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"speculative_config: no *.safetensors or pytorch_model.bin in {path}")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    return state if only is None else {k: v for k, v in state.items() if k == only}


@dataclass
class HeadWeights:
    fc: torch.Tensor  # [3H, H]
    hidden_norm: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [2H, (heads + 2 kv_heads) * hd]
    o_proj: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor  # [H, draft_vocab]
    d2t: torch.Tensor  # [draft_vocab] int64: target id - draft id
    embed: torch.Tensor | None  # None: the target's


class Eagle3Head:
    """Proposer with DraftModel's interface (admitted, propose, accepted) plus `capture`, the
    dict the verify forward fills with the target's hidden states at the head's layers."""

    def __init__(self, rt: "StepHost", model_dir: str, k: int):
        self.cfg, self.layers, draft_vocab = head_config(model_dir, rt.model_cfg)
        self.rt, self.k = rt, k
        self.weights = self._load(Path(model_dir), draft_vocab)
        hidden = self.cfg.hidden_size
        mc, cfg = self.cfg, rt.cfg
        self.rope = rope_table(mc, cfg.max_seq_len, rt.dtype, rt.device)
        self.eps = torch.tensor(mc.rms_norm_eps, dtype=torch.float32, device=rt.device)
        self.inv_hidden = torch.tensor(1 / hidden, dtype=torch.float32, device=rt.device)
        b = cfg.max_batch_size
        spec = AttentionSpec(num_layers=1, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                             num_pages=cfg.total_pages, page_size=cfg.page_size, dtype=rt.dtype,
                             max_tokens=cfg.prefill_capacity + b * (k + 1), max_seqs=2 * b,
                             max_blocks=cfg.max_blocks_per_row)
        backend = get_backend(rt.device.type, cfg.attention_backend)
        options = {"decode_mirror": False} if backend.has_decode_mirror else {}
        self.attn = backend(spec, rt.device, **options).allocate()
        self.first = torch.zeros(b, dtype=torch.int64, device=rt.device)  # each row's next first draft
        self.state = torch.zeros(b, hidden, dtype=rt.dtype, device=rt.device)  # and the head output it came from
        self.ready = np.full(b, -1, np.int64)  # the input position `first` and `state` belong to (-1: none)
        self.capture: dict[int, torch.Tensor] = {}

    def _load(self, path: Path, draft_vocab: int) -> HeadWeights:
        state = _read_tensors(path)
        mc, dt, dev = self.cfg, self.rt.dtype, self.rt.device
        need = ["fc.weight", "norm.weight", "lm_head.weight"] + [f"midlayer.{n}.weight" for n in _LAYER]
        missing = [n for n in need if n not in state]
        if missing:
            raise ValueError(f"speculative_config: the EAGLE-3 head in {path} lacks {missing}")
        h = mc.hidden_size
        expect = {"fc.weight": (h, 3 * h), "lm_head.weight": (draft_vocab, h),
                  "midlayer.self_attn.q_proj.weight": (mc.num_heads * mc.head_dim, 2 * h)}
        for name, shape in expect.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"speculative_config: {name} has shape {tuple(state[name].shape)}, expected {shape} "
                                 f"(the target's hidden_size {h}, draft_vocab_size {draft_vocab})")
        d2t = _check_d2t(state.get("d2t"), draft_vocab, mc.vocab_size)
        w = lambda n: state[n].to(dt).to(dev)  # noqa: E731
        t = lambda *ns: torch.cat([state[f"midlayer.{n}.weight"] for n in ns]).to(dt).t().to(dev)  # noqa: E731
        return HeadWeights(fc=w("fc.weight").t(), hidden_norm=w("midlayer.hidden_norm.weight"),
                           input_norm=w("midlayer.input_layernorm.weight"),
                           post_norm=w("midlayer.post_attention_layernorm.weight"),
                           qkv=t("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                           o_proj=t("self_attn.o_proj"), gate_up=t("mlp.gate_proj", "mlp.up_proj"),
                           down=t("mlp.down_proj"), norm=w("norm.weight"), lm_head=w("lm_head.weight").t(),
                           d2t=d2t.to(dev), embed=w("embed_tokens.weight") if "embed_tokens.weight" in state else None)

    # -- the proposer's interface -----------------------------------------------------------------
    def admitted(self, rows: list[int], cached: list[int]) -> None:
        self.ready[rows] = -1

    @torch.inference_mode()
    def propose(self, rows: np.ndarray, pos: np.ndarray, room: np.ndarray, history: torch.Tensor,
                any_random: bool, any_filter: bool,
                features: Features | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """(drafts [R, k], drafts per row on the host): room[i] for row i, -1 after. A row the head
        has not caught up with (after a preemption or a prefix-cache hit) gets none: its verify
        step (or plain step) feeds the head, and it drafts from the next step on. The head drafts
        greedily: the rows' sampling settings and features apply in verification."""
        rt, k = self.rt, self.k
        rows_t = rt.h2d(rows.astype(np.int64))
        drafts = torch.full((len(rows), k), -1, dtype=torch.int64, device=rt.device)
        ready = np.flatnonzero((self.ready[rows] == pos) & (room > 0))
        counts = np.zeros(len(rows), np.int64)
        counts[ready] = np.minimum(room[ready], k)
        if ready.size:
            at = rt.h2d(ready.astype(np.int64))
            token, hidden = self.first[rows_t[at]], self.state[rows_t[at]]
            drafts[at, 0] = token
            for j in range(1, k):  # head position pos + j - 1: the token at pos + j, and its own output
                keep = np.flatnonzero(room[ready] > j)  # into ready, and into token / hidden / at
                if not keep.size:
                    break
                ready = ready[keep]
                sel = rt.h2d(keep.astype(np.int64))
                axis = packed_axis(rows[ready], pos[ready] + j - 1, np.ones(ready.size, np.int64),
                                   rt.state["block_table"], rt.cfg.page_size, rt.h2d)
                hidden, token = self._forward(token[sel], hidden[sel], axis)
                drafts[at[sel], j] = token
                at = at[sel]
        if rt.cfg.tp_size > 1:  # every rank verifies rank 0's drafts: the counts follow from them
            _broadcast(drafts)
            counts = (drafts >= 0).sum(1).cpu().numpy()
        return drafts, counts

    def capturing(self) -> tuple[tuple[int, ...], dict[int, torch.Tensor]]:
        """What a target forward fills (chip_child.models.qwen3.forward's `aux`), emptied first."""
        self.capture = {}
        return self.layers, self.capture

    @torch.inference_mode()
    def after_plain_step(self, lanes: int, chunks: list, sampled: torch.Tensor, chunk_ids: torch.Tensor | None,
                         decoded: np.ndarray) -> None:
        """A plain step ran (its forward filled `capture`: the lanes, then the chunk tokens):
        the head consumes each decoding lane's position (next token: its sample) and each chunk's
        positions whose next token the step knows (the chunk's own, or the sample after a prompt's
        last; a chunk that does not end its prompt leaves its last position out). `decoded`: the
        lanes that decoded in it, their positions before it."""
        rt = self.rt
        lane_rows = np.flatnonzero(decoded >= 0)
        rows, starts, lengths = [lane_rows], [decoded[lane_rows]], [np.ones(lane_rows.size, np.int64)]
        aux_at, tok_at = [lane_rows], [lane_rows]  # into capture's tokens / into cat(sampled, chunk ids)
        offset = lanes
        for c in chunks:
            n = c.length if c.last else c.length - 1
            if n > 0:
                rows.append(np.array([c.row]))
                starts.append(np.array([c.start]))
                lengths.append(np.array([n]))
                aux_at.append(offset + np.arange(n))
                nxt = offset + 1 + np.arange(n)  # the chunk's next tokens in cat(sampled[:lanes], ids)
                if c.last:
                    nxt[-1] = c.row  # the prompt's last position: the row's sample
                tok_at.append(nxt)
            offset += c.length
        rows_h, starts_h, lengths_h = (np.concatenate(x).astype(np.int64) for x in (rows, starts, lengths))
        if not rows_h.size:
            return
        aux_h, tok_h = np.concatenate(aux_at), np.concatenate(tok_at)
        axis = packed_axis(rows_h, starts_h, lengths_h, rt.state["block_table"], rt.cfg.page_size, rt.h2d,
                           np.concatenate([aux_h, tok_h]).astype(np.int64))
        t = len(aux_h)
        aux = torch.cat([self.capture[i] for i in sorted(self.layers)], -1)
        self.capture = {}
        tokens = sampled[:lanes] if chunk_ids is None else torch.cat([sampled[:lanes], chunk_ids])
        hidden, token = self._forward(tokens[axis.extra[t:]], aux[axis.extra[:t]], axis)
        # Rows whose next input is known now: decoding lanes and prompts that ended.
        ends = np.flatnonzero(np.isin(rows_h, lane_rows) | np.isin(rows_h, [c.row for c in chunks if c.last]))
        if ends.size:
            last = rt.h2d(axis.last[ends].astype(np.int64))
            at = rt.h2d(rows_h[ends])
            self.first[at] = token[last]
            self.state[at] = hidden[last]
            self.ready[rows_h[ends]] = starts_h[ends] + lengths_h[ends]

    @torch.inference_mode()
    def accepted(self, rows: np.ndarray, accepted: np.ndarray, pos: np.ndarray, q: np.ndarray,
                 target: torch.Tensor) -> None:
        """After verification of q[i] tokens from pos[i] (the captured hidden states, packed in
        that order) with accepted[i] drafts: the head consumes positions pos .. pos + accepted
        (their next tokens: target[i, :accepted + 1]) and keeps its output at the last."""
        rt = self.rt
        aux = torch.cat([self.capture[i] for i in sorted(self.layers)], -1)  # in layer order, as vLLM's
        self.capture = {}
        n = accepted + 1
        starts = np.concatenate([[0], np.cumsum(q)[:-1]])
        within = np.concatenate([np.arange(c) for c in n])
        index = np.concatenate([np.repeat(starts, n) + within, np.repeat(np.arange(len(rows)) * target.shape[1], n)
                                + within])
        axis = packed_axis(rows, pos, n, rt.state["block_table"], rt.cfg.page_size, rt.h2d, index)
        t = len(within)
        hidden, token = self._forward(target.reshape(-1)[axis.extra[t:]], aux[axis.extra[:t]], axis)
        last = rt.h2d(axis.last.astype(np.int64))
        rows_t = rt.h2d(rows.astype(np.int64))
        self.first[rows_t] = token[last]
        self.state[rows_t] = hidden[last]
        self.ready[rows] = pos + n

    # -- the head's forward -----------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, hidden: torch.Tensor,
                 axis: PackedAxis) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output [T, H], greedy draft as target ids [T]) of tokens at axis.positions;
        `hidden` is the target's three hidden states [T, 3H] or the head's own output [T, H]."""
        w, mc, rt = self.weights, self.cfg, self.rt
        norm = lambda x, weight: rms_norm(x, weight, self.eps, self.inv_hidden)  # noqa: E731
        if hidden.shape[-1] != mc.hidden_size:
            hidden = hidden @ w.fc
        embeds = F.embedding(tokens, rt.weights.embed if w.embed is None else w.embed)
        x = torch.cat([norm(embeds, w.input_norm), norm(hidden, w.hidden_norm)], -1)
        nh, nkv, hd = mc.num_heads, mc.num_kv_heads, mc.head_dim
        q, k, v = (x @ w.qkv).view(-1, nh + 2 * nkv, hd).split_with_sizes((nh, nkv, nkv), 1)
        cos, sin = self.rope.index_select(0, axis.positions).split_with_sizes((1, 1), 1)
        o = self.attn.forward(0, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, self.attn.plan(axis.meta))
        h = hidden + o.flatten(1) @ w.o_proj
        gate, up = (norm(h, w.post_norm) @ w.gate_up).chunk(2, -1)
        h = h + (F.silu(gate) * up) @ w.down
        ids = (norm(h, w.norm) @ w.lm_head).argmax(-1)
        return h, ids + w.d2t[ids]


def eagle3_proposer(rt: "StepHost", model_dir: str, k: int) -> "Eagle3Head | BroadcastDrafts":
    """Rank 0's proposer is the head; another tensor-parallel rank's receives its drafts."""
    return Eagle3Head(rt, model_dir, k) if rt.cfg.tp_rank == 0 else BroadcastDrafts(rt, k)


class BroadcastDrafts:
    """A tensor-parallel rank other than 0 under eagle3: DraftModel's interface, its drafts rank
    0's (every rank calls propose for the same rows, as the step's host facts decide)."""

    def __init__(self, rt: "StepHost", k: int):
        self.rt, self.k = rt, k

    def admitted(self, rows: list[int], cached: list[int]) -> None:
        pass  # the rows' head state lives on rank 0

    def propose(self, rows: np.ndarray, pos: np.ndarray, room: np.ndarray, history: torch.Tensor,
                any_random: bool, any_filter: bool,
                features: Features | None = None) -> tuple[torch.Tensor, np.ndarray]:
        drafts = _broadcast(torch.empty((len(rows), self.k), dtype=torch.int64, device=self.rt.device))
        return drafts, (drafts >= 0).sum(1).cpu().numpy()

    def accepted(self, rows: np.ndarray, accepted: np.ndarray) -> None:
        pass


def _broadcast(drafts: torch.Tensor) -> torch.Tensor:
    """Rank 0's drafts into `drafts` on every rank (the process group the target's all-reduce uses)."""
    import torch.distributed as dist

    dist.broadcast(drafts, 0)
    return drafts
