"""DeepSeek-V3's mixture-of-experts MLP for the continuous engine's MLA decoder (`mla_decoder.py`),
read from the `transformers` model's own weights (DeepseekV3MoE: its TopkRouter, fused 3D experts
and always-on shared experts).

For the tokens x_t of a pass (x_t already normed by post_attention_layernorm), in float32 as
transformers' DeepseekV3TopkRouter computes it:

    s_t      = σ(W_r · x_t)                                   (sigmoid scores, [E])
    c_t      = s_t + b                                        (b: e_score_correction_bias, choice only)
    groups   = the topk_group of the n_group expert groups with the largest (sum of a group's 2 best c)
    E_t      = the top-k of c_t over the experts of those groups
    w_t      = s_t[E_t] (÷ (Σ s_t[E_t] + 1e-20) when norm_topk_prob) · routed_scaling_factor
    y_t      = Σ_{e ∈ E_t} w_{t,e} · W_down[e] · (silu(W_gate[e]·x_t) ⊙ W_up[e]·x_t)
             + W_down_s · (silu(W_gate_s·x_t) ⊙ W_up_s·x_t)                   (the shared experts, ungated)

The routed experts run grouped by expert over all the pass's tokens (`moe_block.grouped_experts_into`:
one grouped GEMM per weight, batched across rows); `route_deepseek` is the one place experts are
chosen, and the decoder's `on_route(layer, ids)` is told each choice (routing records).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_core.rollout.moe_block import grouped_experts_into


@dataclass
class DeepseekRouter:
    """`weight` [E, hidden] and `bias` [E] (e_score_correction_bias) are views of the model's own
    (float32) router parameter and buffer; the rest is the router's configuration."""

    weight: torch.Tensor
    bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    normalize: bool
    scaling: float


@dataclass
class DeepseekMoe:
    """One DeepseekV3MoE: `gate_up` [E, 2I, hidden] (gate rows first), `down` [E, hidden, I] views of
    the experts' parameters; the shared experts' fused gate|up [2·I_s, hidden] and down [hidden, I_s]."""

    layer: int
    router: DeepseekRouter
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_gate_up: torch.Tensor
    shared_down: torch.Tensor


def route_deepseek(hidden: torch.Tensor, gate: DeepseekRouter) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k]) of tokens `hidden` [T, hidden] (module docstring), the
    same operations as transformers' DeepseekV3TopkRouter (so the same ids in the same order);
    the weights in hidden's dtype."""
    scores = F.linear(hidden.float(), gate.weight.float()).sigmoid()
    choice = scores + gate.bias
    per_group = choice.view(-1, gate.n_group, choice.shape[-1] // gate.n_group)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~kept.repeat_interleave(per_group.shape[-1], dim=-1), float("-inf"))
    ids = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if gate.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * gate.scaling).to(hidden.dtype)


def deepseek_moe_into(
    block: DeepseekMoe,
    x: torch.Tensor,
    normed: torch.Tensor,
    on_route: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """x + y: the block's output y (module docstring) for `normed` [T, hidden], added to the residual x.
    `on_route(layer, topk_ids)`: told the experts chosen."""
    ids, weights = route_deepseek(normed, block.router)
    if on_route is not None:
        on_route(block.layer, ids)
    g, u = F.linear(normed, block.shared_gate_up).chunk(2, dim=-1)
    out = torch.addmm(x, F.silu(g).mul_(u), block.shared_down.t())
    return grouped_experts_into(out, normed, ids, weights, block.gate_up, block.down)


def read_deepseek_moe(mlp: torch.nn.Module, layer: int, old: DeepseekMoe | None = None) -> DeepseekMoe | None:
    """Layer `layer`'s MLP as a DeepseekMoe; None for a dense one (the first_k_dense_replace layers).
    `old`: the block read before a weight swap, whose fused shared gate|up buffer is refilled in place."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return None
    gate, shared = mlp.gate, mlp.shared_experts
    router = DeepseekRouter(
        gate.weight,
        gate.e_score_correction_bias,
        int(gate.top_k),
        int(gate.num_group),
        int(gate.topk_group),
        bool(gate.norm_topk_prob),
        float(gate.routed_scaling_factor),
    )
    shared_gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
    if old is not None:
        shared_gate_up = old.shared_gate_up.copy_(shared_gate_up)
    return DeepseekMoe(layer, router, experts.gate_up_proj, experts.down_proj, shared_gate_up, shared.down_proj.weight)


def unsupported_deepseek_moe(model: torch.nn.Module) -> str | None:
    """What `deepseek_moe_into` would compute differently from the model's sparse blocks (None: nothing)."""
    for i, blk in enumerate(model.model.layers):
        experts = getattr(blk.mlp, "experts", None)
        if experts is None:
            continue
        if type(blk.mlp.gate).__name__ != "DeepseekV3TopkRouter" or not hasattr(blk.mlp, "shared_experts"):
            return f"layer {i}'s sparse block is not DeepSeek-V3's sigmoid router with shared experts"
        if getattr(experts, "has_bias", False) or experts.gate_up_proj.dim() != 3:
            return f"layer {i}'s experts are not [E, 2I, hidden] gate|up and [E, hidden, I] down without biases"
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            return f"layer {i}'s experts are not [E, 2I, hidden] gate|up and [E, hidden, I] down without biases"
    return None
