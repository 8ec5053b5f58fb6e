"""The continuous-engine equality checks' shared measure: the HF forward's log-probs of what an engine generated."""

from __future__ import annotations

import torch


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    """The HF model's float32 logits [len(seq), V] of one sequence."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0].float()


def logprob_gaps(served, prompts: list[list[int]], params, gens, temperature: float) -> torch.Tensor:
    """|Δ log p| of every generated token: the engine's stored log-prob against log softmax(z / T) of the HF
    forward of the whole sequence (prompt + generation); every request ran to its max_new_tokens."""
    assert [len(g.token_ids) for g in gens] == [p.max_new_tokens for p in params]
    gaps = []
    for p, g in zip(prompts, gens):
        ref = torch.log_softmax(hf_logits(served, p + g.token_ids)[len(p) - 1 : -1] / temperature, -1)
        gaps.append((ref.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0] - torch.tensor(g.logprobs)).abs())
    return torch.cat(gaps)
