"""Per-token log-probabilities of a causal LM, aligned with input positions."""

from __future__ import annotations

import torch


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0, **model_inputs
) -> torch.Tensor:
    """logp[:, t] = log π(x_t | x_<t) for t >= 1 and 0 at t = 0; right-padded batches.
    `model_inputs`: further forward() arguments (a VLM's pixel values, image grids and mrope
    positions: areal_core/vlm/inputs.py)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))
