"""Token log-probs from the final hidden states, the LM head applied a chunk of tokens at a time, so
that memory holds O(chunk × vocab) logits, not O(tokens × vocab) (a 151,936-row vocabulary at
32k tokens is ~20 GB of float32 logits per copy).

For the hidden states h_t of the positions that predict tokens x_{t+1}, per chunk C of at most
`chunk` positions (τ the temperature, z = head(h) the model's logits):

    lp_t = z_t[x_{t+1}] / τ − logsumexp(z_t / τ)           H_t = logsumexp(z_t / τ) − Σ_v p_v z_v / τ

With gradients on, each chunk runs under activation checkpointing: its logits are recomputed in
the backward pass instead of being kept, so the backward's peak is one chunk's too.

`head(h)` is the model's output embedding plus what its CausalLM applies after it: Gemma's
final_logit_softcapping (z = c·tanh(z/c)), Granite's logits_scaling (z / s), Cohere's logit_scale
(z·s). Any other post-processing would differ, so the first use on each model compares the chunked
log-probs with the model's own forward on a few tokens (`LogitHead.for_model`). A model that does
not match, a sharded (FSDP2) head, or an architecture without a decoder (its base_model_prefix)
and an output embedding keeps the full-logits path.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("areal.train")

CHECK_TOKENS = 24  # tokens of the first batch compared against the model's own forward
CHECK_TOL = 1e-4  # max |Δ log p| of that comparison (float32: ~1e-6)
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_function(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """logits = head(hidden) as the model's CausalLM computes them, or None when it cannot be
    applied by itself here (no decoder/head pair, or a sharded head)."""
    base = _base(model)
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if out is None or _decoder(base) is None or type(out.weight).__name__ == "DTensor":
        return None
    cfg = base.config
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scaling = getattr(cfg, "logits_scaling", None)
    scale = getattr(base, "logit_scale", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        z = out(h)
        if scaling:
            z = z / scaling
        if isinstance(scale, (int, float)):
            z = z * scale
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        return z

    return head


def _decoder(base: Any) -> Any:
    """The CausalLM's decoder (`model`, `gpt_neox`, ...: its base_model_prefix), or None."""
    decoder = getattr(base, getattr(base, "base_model_prefix", "") or "model", None)
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not base else None


def decoder_module(model: Any) -> torch.nn.Module | None:
    """The decoder of `model` (a PEFT wrapper's base model's), whose output the LM head reads; or None."""
    return _decoder(_base(model))


def hidden_states(model: Any, **inputs: Any) -> torch.Tensor:
    """The decoder's final (normed) hidden states, the input of the LM head."""
    return _decoder(_base(model))(**inputs, use_cache=False).last_hidden_state


def _chunk(head, h: torch.Tensor, target: torch.Tensor, temperature: float, entropy: bool) -> torch.Tensor:
    z = head(h).float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, target[:, None]).squeeze(-1) - lse
    if not entropy:
        return lp
    return torch.stack([lp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)])


def chunked_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 512,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """lp [M] (and entropy [M]) of `targets` [M] from `hidden` [M, H] (module docstring)."""
    parts = []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, hidden.shape[0], max(chunk, 1)):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if grad:
            parts.append(checkpoint(_chunk, head, h, t, temperature, with_entropy, use_reentrant=False))
        else:
            parts.append(_chunk(head, h, t, temperature, with_entropy))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty) if with_entropy else empty
    out = torch.cat(parts, dim=-1)
    return (out[0], out[1]) if with_entropy else out


class LogitHead:
    """The chunked head of a model, checked once against its own forward (module docstring)."""

    @staticmethod
    def for_model(model: Any, input_ids: torch.Tensor, chunk: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The head to use in chunks for `model`, or None (full logits): `chunk` ≤ 0, no usable
        head, or a first comparison on `input_ids[0]` that disagrees with the model's forward."""
        if chunk <= 0:
            return None
        head = head_function(model)
        if head is None:
            return None
        base = _base(model)
        if base not in _CHECKED:
            _CHECKED[base] = _agrees(model, head, input_ids[0, :CHECK_TOKENS])
        return head if _CHECKED[base] else None


@torch.no_grad()
def _agrees(model: Any, head, ids: torch.Tensor) -> bool:
    ids = ids[None].to(next(model.parameters()).device)
    if ids.shape[1] < 2:
        return True
    want = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    want = want.gather(-1, ids[0, 1:, None]).squeeze(-1)
    got = chunked_logprobs(head, hidden_states(model, input_ids=ids)[0, :-1], ids[0, 1:], chunk=8)
    gap = float((want - got).abs().max())
    if gap > CHECK_TOL:
        log.warning(
            "%s: log-probs from the LM head in chunks differ from its forward by %.2e; using full logits",
            type(_base(model)).__name__,
            gap,
        )
    return gap <= CHECK_TOL
