"""Entropy of the next-token distribution from logits, aligned like `token_logprobs`."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v, over the last dim (float32)."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def entropy_from_logprobs(logz: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p_v log p_v from log-probs over the last dim; tokens at −inf (masked out) add 0 and
    keep the gradient finite (0 · log 0 taken as 0 before, not after, differentiation)."""
    return -(logz.exp() * logz.masked_fill(torch.isinf(logz), 0.0)).sum(-1)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """From logits[N, T, V] of a causal LM: (logp, entropy), [N, T] each.

    logp[:, t] = log π(x_t | x_<t) and entropy[:, t] = H(π(· | x_<t)) for t ≥ 1; 0 at t = 0.
    """
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    logz = torch.log_softmax(z, dim=-1)
    logp = logz.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logz.exp() * logz).sum(-1)  # no −inf here: skip entropy_from_logprobs's vocabulary-sized mask
    pad = torch.nn.functional.pad
    return pad(logp, (1, 0)), pad(ent, (1, 0))


def token_logprobs_and_entropy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded forward pass; (logp, entropy) aligned with input positions (see `token_logprobs`)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logprobs_and_entropy_from_logits(logits, input_ids, temperature)
