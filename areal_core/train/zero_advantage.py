"""Rows whose advantages are all zero, left out of the policy passes where that changes nothing.

Under an advantage-weighted loss (`Loss.advantage_weighted`: every term of row i is its advantage times a
function of the row), a row with A_{i,t} = 0 on every policy token adds exactly nothing to the minibatch's
loss or gradient:

    L_M = (1/D_M) · Σ_i Σ_t m_{i,t} · A_{i,t} · f(θ; i, t)   ⇒   ∇L_M = (1/D_M) · Σ_{i: A_i ≠ 0} ∇ℓ_i,

where D_M is the minibatch's denominator (its tokens, sequences, or Dr.GRPO's constant) and still counts
the skipped rows (`LossInputs.global_tokens` / `global_seqs`, as micro-batches and FSDP ranks use them).
So the forward and backward run on the other rows only. GRPO gives a group whose rewards are all equal
advantage 0 on every row: on the default job that is half to three quarters of the rows once the policy
is good (docs/benchmarks.md), half to three quarters of the trainer's compute.

The skip is exact in exact arithmetic; in float32 the sums run over fewer terms (|Δθ| ~1e-7 a step). The
per-token metrics of the passes (clip fractions, ratios, importance weights, entropy) are then means over
the rows trained on; the loss, the gradient norm and the batch's advantage metrics are the whole batch's.

Never skipped (the rows are trained as before), because a zero-advantage row would still move θ:
  - a KL loss term towards π_ref (`algo.kl_coef` > 0 without `kl_as_reward`), an entropy bonus
    (`algo.entropy_coef` > 0), a critic (its value loss reads every row);
  - a loss that is not advantage-weighted (distillation, preference losses) or whose terms depend on other
    rows (M2PO's mask is a statistic of the whole minibatch: not `distributed`).
A row whose advantages are only nearly zero (batch-normalised advantages, a KL-shaped reward) is trained.
"""

from __future__ import annotations

import torch

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.loss.registry import active_losses, get_loss


def skip_refusal(cfg: AlgorithmConfig, critic: bool) -> str:
    """Why zero-advantage rows must be trained under `cfg` ("" when they may be skipped)."""
    policy = get_loss(cfg.loss)
    if critic:
        return "a critic is trained on every row"
    if cfg.kl_coef > 0 and not cfg.kl_as_reward and policy.kl_term:
        return "algo.kl_coef adds a KL term on every row"
    if cfg.entropy_coef > 0:
        return "algo.entropy_coef adds an entropy bonus on every row"
    for loss in active_losses(cfg):
        if not (loss.advantage_weighted and loss.distributed):
            return f"loss {loss.name!r} is not advantage-weighted row by row"
    return ""


def inert_rows(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows whose advantage is exactly 0 on every policy token (or that have none)."""
    return ~((advantages != 0) & loss_mask.bool()).any(dim=1)


def trained_rows(
    rows: torch.Tensor, inert: torch.Tensor | None, reach: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool]:
    """`rows` less the inert ones, and whether none is left. None left: one row, to be run with its loss mask
    zeroed, so every parameter still gets a gradient (zero), as without the skip: AdamW moves a parameter with a
    zero gradient (its moments decay, its weight decays) but leaves one without any untouched.

    `reach`: [N] bool, the rows that reach parameters the others do not (a VLM's rows with images reach the vision
    tower). When `rows` hold such a row and the kept rows none, the first of them is kept too: inert, its loss and
    gradient are exactly 0, and those parameters get their zero gradient as without the skip (the masked row when
    none is left is this one)."""
    if inert is None or len(rows) == 0:
        return rows, False
    kept = rows[~inert[rows]]
    if reach is not None and bool(reach[rows].any()) and not bool(reach[kept].any()):
        first = rows[reach[rows]][:1]
        if len(kept) == 0:
            return first, True
        return torch.sort(torch.cat([kept, first])).values, False
    if len(kept) == 0:
        return rows[:1], True
    return kept, False
