"""The check every parity test makes: greedy tokens equal transformers' generate, and each
step's logits within a relative tolerance of transformers' forward over the same tokens."""
from __future__ import annotations

import torch


def hf_greedy(model, prompt: list[int], n: int, ignore_eos: bool = True) -> list[int]:
    """transformers' greedy tokens after `prompt`: n of them, or up to an EOS with ignore_eos=False."""
    ids = torch.tensor([prompt])
    extra = {"min_new_tokens": n, "eos_token_id": None} if ignore_eos else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         **extra)
    return out[0, len(prompt):].tolist()


def assert_matches_transformers(model, prompts: list[list[int]], token_ids: list[list[int]],
                                logits: list[list[torch.Tensor]], new_tokens: int, rel_tol: float = 1e-4) -> None:
    for prompt, tokens, steps in zip(prompts, token_ids, logits):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
            want = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        assert tokens == ref[0, len(prompt):].tolist(), f"greedy tokens differ for prompt length {len(prompt)}"
        assert len(steps) == new_tokens
        for step, (mine, expected) in enumerate(zip(steps, want)):
            rel = ((mine.cpu() - expected).abs().max() / expected.abs().max()).item()
            assert rel <= rel_tol, f"prompt length {len(prompt)}, step {step}: relative logits error {rel:.2e}"
