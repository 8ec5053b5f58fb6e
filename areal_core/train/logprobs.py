"""Per-token log-probabilities of a causal LM, aligned with input positions."""

from __future__ import annotations

from typing import Any

import torch

from areal_core.train.entropy import entropy_from_logprobs
from areal_core.train.head import LogitHead, chunked_logprobs, hidden_states


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    banned: tuple[int, ...] = (),
    with_entropy: bool = False,
    logit_chunk: int = 0,
    **model_inputs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """logp[:, t] = log π(x_t | x_<t) for t >= 1 and 0 at t = 0; right-padded batches.
    `model_inputs`: further forward() arguments (a VLM's pixel values, image grids and mrope
    positions: areal_core/vlm/inputs.py); `banned`: tokens the policy cannot emit (a VLM's vision
    placeholders, masked as the engine masks them), whose targets in the prompt get 0.
    with_entropy: also H[:, t] = −Σ_v π(v | x_<t) log π(v | x_<t) over the tokens it can emit
    (0 at t = 0), returned as (logp, H). `logit_chunk` > 0: the LM head applied that many tokens
    at a time from the final hidden states (train/head.py; text models), never all logits at once."""
    head = None if banned or model_inputs else LogitHead.for_model(model, input_ids, logit_chunk)
    if head is not None:
        h = hidden_states(model, input_ids=input_ids, attention_mask=attention_mask)
        n, t = input_ids.shape
        flat = h[:, :-1].reshape(-1, h.shape[-1])
        res = chunked_logprobs(head, flat, input_ids[:, 1:].reshape(-1), temperature, logit_chunk, with_entropy)
        pad = torch.nn.functional.pad
        if not with_entropy:
            return pad(res.view(n, t - 1), (1, 0))
        return pad(res[0].view(n, t - 1), (1, 0)), pad(res[1].view(n, t - 1), (1, 0))
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    if banned:
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
    logz = torch.log_softmax(logits, dim=-1)
    logp = logz.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if banned:
        logp = logp.masked_fill(torch.isin(input_ids[:, 1:], torch.tensor(banned, device=logp.device)), 0.0)
    logp = torch.nn.functional.pad(logp, (1, 0))
    if not with_entropy:
        return logp
    return logp, torch.nn.functional.pad(entropy_from_logprobs(logz), (1, 0))  # banned tokens add 0
