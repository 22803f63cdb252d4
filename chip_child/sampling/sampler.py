"""On-device sampling: greedy, temperature, min-p, top-k, top-p, with per-row seeds; the stop-id
mask of min_tokens, the repetition/frequency/presence penalties, and log-probabilities.

Random rows use the Gumbel-max trick with noise from a counter-based hash of
(row seed, position, token id). The noise a request sees depends on nothing but its own seed and
position, so a seeded request gives the same tokens whatever else shares the batch, and no
generator state has to live anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chip_child.cpu_kernels import sampling_noise
from chip_child.sampling.grammar import allowed_tokens
from chip_child.sampling.noise import torch_uniform_noise
from chip_child.sampling.seeds import seed_key  # noqa: F401  seed_key: the keys this noise is drawn with
from chip_child.sampling.top_k_top_p import draw_among, filter_rows, mask_below

ONE_THREAD_NOISE = 1 << 14  # noise values that gumbel_noise takes on one thread (see there)


def uniform_noise(keys: torch.Tensor, counters: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[N, V] floats in (0, 1), a pure function of (key, counter, token id). On the cpu, our
    kernel (chip_child.cpu_kernels.sampling_noise) where it runs: the same bits in one pass."""
    if keys.device.type == "cpu":
        lib = sampling_noise.KERNEL.library()
        if lib is not None:
            return sampling_noise.uniform_noise(lib, keys, counters, vocab_keys)
    return torch_uniform_noise(keys, counters, vocab_keys)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks with -inf everything outside each row's top-k, then outside its top-p nucleus
    (top_k 0 and top_p 1 disable a filter), as transformers' warpers do in that order; tokens
    tied at a row's cutoff all stay (chip_child.sampling.top_k_top_p)."""
    return mask_below(logits, filter_rows(logits, top_k, top_p).cutoff)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    counters: torch.Tensor,
    vocab_keys: torch.Tensor,
    any_random: bool,
    any_filter: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids [N] (int64). `any_random`/`any_filter` are host-side facts about the rows,
    kept by the runtime, so an all-greedy batch costs one argmax; `min_p` [N] (None: no row uses
    it) filters the tempered distribution before top-k and top-p. Greedy rows take the argmax."""
    greedy = first_max(logits)
    if not any_random:
        return greedy
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    if min_p is not None:
        scaled = filter_min_p(scaled, min_p)
    drawn = temperature > 0
    filtered = filter_rows(scaled, top_k, top_p, drawn) if any_filter else None
    if filtered is not None and filtered.complete:
        return torch.where(drawn, draw_among(filtered, keys, counters, vocab_keys), greedy)
    gumbel = gumbel_noise(uniform_noise(keys, counters, vocab_keys)).add_(scaled)
    if filtered is not None:
        gumbel.masked_fill_(scaled < filtered.cutoff[:, None], float("-inf"))
    return torch.where(drawn, first_max(gumbel), greedy)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """-log(-log(u)), in place on the fresh noise `u`: the same values, two [N, V] buffers fewer.
    Up to ONE_THREAD_NOISE values on one thread: the same bits either way, but MKL's log splits even
    one 4,096-value row over the whole OpenMP team (13 us either way on 2 cores), which wakes its
    other threads once a step, after which they spin beside the next step's work and the server's."""
    threads = torch.get_num_threads()
    if threads == 1 or u.numel() > ONE_THREAD_NOISE or u.device.type != "cpu":
        return u.log_().neg_().log_().neg_()
    torch.set_num_threads(1)
    try:
        return u.log_().neg_().log_().neg_()
    finally:
        torch.set_num_threads(threads)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension: the index of the first largest value (a NaN counts as the
    largest), as `argmax` gives it. On the cpu, numpy's argmax of the same memory: the same
    indices, about 17x faster than torch's at a 151,936 vocabulary (one row: 0.02 against 0.37 ms;
    16 rows: 0.25 against 2.8 ms; torch 2.13, numpy 2), which a step pays once or twice.
    Elsewhere `max(dim).indices`, 3x faster than `argmax` on a cpu (16 x 32,000 fp32: 0.12
    against 0.35 ms)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.max(dim=-1).indices


def filter_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks with -inf every token whose probability (softmax of the tempered logits `scaled`) is
    below min_p times the row's largest. A row with min_p 0 keeps everything; the most likely
    token always stays."""
    probs = scaled.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < floor, float("-inf"))


def mask_stop_tokens(logits: torch.Tensor, stop_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """-inf at the stop ids (`stop_mask` [N, V]) of the rows still short of their min_tokens
    (`rows` [N] bool)."""
    return logits.masked_fill(stop_mask & rows[:, None], float("-inf"))


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The repetition, frequency and presence penalties, per row, on fp32 logits [N, V].

    A token seen in the prompt (`prompt_seen`, 1.0 or 0.0) or the output (`output_counts` > 0)
    has its logit divided by the repetition penalty when positive, multiplied by it otherwise;
    then each output occurrence subtracts `frequency` and any output occurrence `presence`.
    Neutral values (1, 0, 0) leave a row's logits as they were, bit for bit.

    Written as float arithmetic only: on the cpu, ops that read or write bool tensors (compare,
    where, masked_fill) are several times slower than these, which the penalties would pay on
    [rows, vocab] every step."""
    in_output = output_counts.clamp(max=1)  # 1.0 where the token occurs in the output
    seen = torch.maximum(prompt_seen, in_output)
    # (1 - seen) + seen * penalty: exactly the penalty where the token was seen, 1 elsewhere.
    scale = torch.sub(1, seen).addcmul_(seen, repetition[:, None])
    # A logit is either positive or not: one of the two terms is zero.
    out = logits.clamp(max=0).mul_(scale).add_(logits.clamp(min=0).div_(scale))
    out.sub_(output_counts * frequency[:, None])
    return out.sub_(in_output.mul_(presence[:, None]))


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, ids: torch.Tensor, num: int,
                   values: torch.Tensor, top_ids: torch.Tensor) -> None:
    """Log-probabilities of the distribution a row samples from: log_softmax of `logits` (after
    masks and penalties) over the row's temperature, 1 for greedy rows. Writes the chosen `ids`'
    values into values[:, 0] and the `num` most likely tokens' values and ids, most likely first,
    into values[:, 1:1 + num] and top_ids[:, :num]."""
    tempered = torch.where(temperature > 0, temperature.clamp_min(1e-6), 1.0)
    logprobs = (logits / tempered[:, None]).log_softmax(dim=-1)
    values[:, 0] = logprobs.gather(1, ids[:, None]).squeeze(1)
    if num > 0:
        top = logprobs.topk(num, dim=-1)
        values[:, 1:1 + num] = top.values
        top_ids[:, :num] = top.indices


@dataclass(frozen=True)
class Features:
    """Which optional stages a batch of rows runs: host facts, so a batch that uses none of them
    runs `sample` alone. `logprobs` is the largest N any row asked for (-1: none)."""

    penalties: bool = False
    min_p: bool = False
    stop_mask: bool = False
    logprobs: int = -1
    grammar: bool = False  # some row is held to a grammar: its token bitmask applies


@dataclass
class RowParams:
    """Per-row sampling state on the device, [N] or [N, V], row i of every tensor being one row."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    keys: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_pos: torch.Tensor  # stop ids are masked while the input position is below this
    output_counts: torch.Tensor  # float32 [N, V]: occurrences of each token in the row's output so far
    prompt_seen: torch.Tensor  # float32 [N, V]: 1.0 where the token occurs in the row's prompt
    stop_mask: torch.Tensor  # bool [N, V]: the row's stop ids
    grammar_mask: torch.Tensor | None = None  # int32 [N, ceil(V / 32)]: what a row's grammar allows (all bits: any)

    @classmethod
    def of_state(cls, v: dict[str, torch.Tensor]) -> "RowParams":
        """From the runtime's pooled row tensors (or a lane bucket's views of them), by slot name."""
        return cls(v["temperature"], v["top_k"], v["top_p"], v["seed_keys"], v["min_p"], v["presence_penalty"],
                   v["frequency_penalty"], v["repetition_penalty"], v["min_pos"], v["output_counts"],
                   v["prompt_seen"], v["stop_mask"], v["grammar_mask"])

    def select(self, rows: torch.Tensor) -> "RowParams":
        return RowParams(**{name: None if value is None else value[rows] for name, value in vars(self).items()})


def sample_at_positions(logits: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor,
                        positions: torch.Tensor, any_random: bool, any_filter: bool,
                        features: "Features | None",
                        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Ids for tokens of rows `rows` at `positions` (several a row, as speculation verifies or
    drafts them), from the runtime's pooled row tensors: the plain sampler with the stages that
    depend on a position alone (min_tokens' stop mask, min_p), so each token is the one a plain
    step would sample there. Penalties and grammars are left to the caller.

    `logprobs` (at, values, ids), given with features.logprobs >= 0: the log-probabilities of the
    tokens `at` (indices into `logits`), of rows using neither penalties nor a grammar, into
    values [len(at), 1 + N] and ids [len(at), N], N = features.logprobs: what
    `sample_with_features` writes for them in a plain step (penalties at neutral values and an
    all-allowing mask leave their logits as they are)."""
    x, min_p = logits, None
    if features is not None and features.stop_mask:
        x = mask_stop_tokens(logits, state["stop_mask"][rows], positions < state["min_pos"][rows])
    if features is not None and features.min_p:
        min_p = state["min_p"][rows]
    temperature = state["temperature"][rows]
    ids = sample(x, temperature, state["top_k"][rows], state["top_p"][rows], state["seed_keys"][rows], positions,
                 state["vocab_keys"], any_random, any_filter, min_p=min_p)
    if logprobs is not None:
        at, values, top_ids = logprobs
        token_logprobs(x[at], temperature[at], ids[at], features.logprobs, values, top_ids)
    return ids


def sample_with_features(logits: torch.Tensor, p: RowParams, counters: torch.Tensor, vocab_keys: torch.Tensor,
                         any_random: bool, any_filter: bool, features: Features,
                         lp_values: torch.Tensor | None = None, lp_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` with the optional stages in their order: the grammar's token bitmask, stop ids
    masked for rows short of min_tokens, then penalties, then (inside `sample`) temperature, min_p, top-k, top-p and the
    seeded draw. With features.logprobs >= 0 the log-probabilities of the sampled distribution
    (before min_p, top-k and top-p) go to `lp_values` [N, 1 + K] and `lp_ids` [N, K]. A row that
    uses none of the stages gets exactly the id `sample` would give it."""
    x = logits
    if features.grammar:  # before everything, so the log-probabilities are those of the constrained row
        x = logits.masked_fill(~allowed_tokens(p.grammar_mask, logits.shape[1]), float("-inf"))
    if features.stop_mask:
        x = mask_stop_tokens(x, p.stop_mask, counters < p.min_pos)
    if features.penalties:
        x = apply_penalties(x, p.output_counts, p.prompt_seen, p.presence, p.frequency, p.repetition)
    ids = sample(x, p.temperature, p.top_k, p.top_p, p.keys, counters, vocab_keys, any_random, any_filter,
                 min_p=p.min_p if features.min_p else None)
    if features.logprobs >= 0:
        token_logprobs(x, p.temperature, ids, features.logprobs, lp_values, lp_ids)
    return ids
