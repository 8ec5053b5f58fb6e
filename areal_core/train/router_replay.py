"""Routing replay (R3): the trainer's MoE forwards run on the experts the rollout engine chose.

A bfloat16 engine and the float32 trainer see slightly different hidden states, and where two
experts' router logits nearly tie they pick different experts for the same token: the trainer
then scores a token with other experts than the ones that sampled it, and the gap shows up in the
importance weight π_prox/π_behav as if the policy had moved. With `algo.router_replay: rollout`
the π_θ and π_prox forwards take the experts recorded with each sample (areal_core/routes.py) and
recompute only their gate weights under the trainer's router, which keeps the router trained.

For a token with router logits z ∈ R^E and recorded experts e_1..e_k, following each
architecture's own gating (transformers' router classes):

  Qwen2-MoE, Qwen3-MoE, Mixtral   p = softmax(z) over all E;  w_j = p_{e_j};
                                  norm_topk_prob (Mixtral: always): w_j ← w_j / Σ_i w_i
  DeepSeek-V3                     s = σ(z);  w_j = s_{e_j} (the correction bias and the group limit
                                  only choose experts); norm_topk_prob: w_j ← w_j / (Σ_i w_i + 1e-20);
                                  w_j ← routed_scaling_factor · w_j
  gpt-oss                         w = softmax(z_{e_1}, ..., z_{e_k}) (over the k logits only)

`RouteReplay(model, routes, force)` patches every router's `forward` while entered (forward and
backward: a checkpointed layer recomputes its router in the backward) and restores it on exit.
`routes` [rows, T, layers, k] (train/batch.py:route_tensor, on the host; one layer's slice moves to
the device per call) hold its sentinel where nothing was recorded: those token-layers keep the
trainer's own choice and weights. With `force=False` it only observes: the trainer's own routes,
and the tally of how often they are the recorded ones. The forward must see the rows unpacked
([rows·T] tokens in row-major order): the step runs replayed forwards unpacked.

Routing agreement = (token-layers whose own top-k set equals the recorded set) / (token-layers
recorded), from an unforced forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from areal_core.routes import moe_routers
from areal_core.train.batch import route_sentinel


def softmax_gate(logits: torch.Tensor, experts: torch.Tensor, normalise: bool) -> torch.Tensor:
    """w_j = softmax(z)_{e_j} over all experts (float32), divided by Σ_i w_i when `normalise`."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return weights / weights.sum(-1, keepdim=True) if normalise else weights


def sigmoid_gate(logits: torch.Tensor, experts: torch.Tensor, normalise: bool, scale: float) -> torch.Tensor:
    """DeepSeek-V3: w_j = σ(z)_{e_j}, divided by (Σ_i w_i + 1e-20) when `normalise`, times `scale`."""
    weights = torch.sigmoid(logits.float()).gather(-1, experts)
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale


def topk_softmax_gate(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """gpt-oss: w = softmax over the k chosen logits z_{e_j} only, in the logits' dtype."""
    return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=logits.dtype)


Gate = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
GATES: dict[str, Gate] = {  # router class -> weights of the given experts, as its own forward computes them
    "Qwen2MoeTopKRouter": lambda r, z, e: softmax_gate(z, e, r.norm_topk_prob).to(z.dtype),
    "Qwen3MoeTopKRouter": lambda r, z, e: softmax_gate(z, e, r.norm_topk_prob).to(z.dtype),
    "MixtralTopKRouter": lambda r, z, e: softmax_gate(z, e, True),
    "DeepseekV3TopkRouter": lambda r, z, e: sigmoid_gate(z, e, r.norm_topk_prob, r.routed_scaling_factor),
    "GptOssTopKRouter": lambda r, z, e: topk_softmax_gate(z, e),
}


def same_experts(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: the two [tokens, k] choices hold the same set of experts (order aside)."""
    return (own.sort(-1).values == recorded.sort(-1).values).all(-1)


@dataclass
class RouteTally:
    """Token-layers with a recorded route, and those whose own choice was the recorded one."""

    agree: int = 0
    recorded: int = 0

    def add(self, own: torch.Tensor, recorded: torch.Tensor, known: torch.Tensor) -> None:
        self.recorded += int(known.sum())
        self.agree += int((same_experts(own, recorded) & known).sum())

    @property
    def agreement(self) -> float:
        return self.agree / self.recorded if self.recorded else float("nan")


class RouteReplay:
    """While entered, `model`'s routers take `routes` ([rows, T, layers, k]; route_sentinel: not recorded) when
    `force`, and count in `tally` how often their own choice agrees (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, routes: torch.Tensor, force: bool = True, tally: RouteTally | None = None
    ):
        self.routers = moe_routers(model)
        if routes.shape[-2] != len(self.routers):
            raise ValueError(f"routes of {routes.shape[-2]} MoE layers for a model with {len(self.routers)} routers")
        unknown = sorted({type(r).__name__ for r in self.routers} - set(GATES))
        if unknown and force:
            raise ValueError(f"no replayed gating for router classes {unknown}")
        self.routes = routes.reshape(-1, *routes.shape[-2:])  # [rows·T, layers, k], on the host
        self.sentinel = route_sentinel(routes)
        self.force = force
        self.tally = tally if tally is not None else RouteTally()

    def __enter__(self) -> RouteReplay:
        self._saved = [router.__dict__.get("forward") for router in self.routers]
        for layer, router in enumerate(self.routers):
            router.forward = self._forward(router, layer, router.forward)
        return self

    def __exit__(self, *exc: object) -> None:
        for router, saved in zip(self.routers, self._saved):
            if saved is None:
                router.__dict__.pop("forward", None)
            else:
                router.forward = saved

    def _forward(self, router: Any, layer: int, original: Callable) -> Callable:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
            logits, weights, own = original(hidden_states, *args, **kwargs)
            if own.shape[0] != self.routes.shape[0]:
                raise RuntimeError(
                    f"router replay: a forward over {own.shape[0]} tokens, routes for {self.routes.shape[0]} "
                    "(replayed forwards must run unpacked, one row per sample)"
                )
            recorded = self.routes[:, layer].to(own.device, torch.long)
            known = (recorded != self.sentinel).all(-1)
            self.tally.add(own, recorded, known)
            if not self.force:
                return logits, weights, own
            experts = torch.where(known[:, None], recorded, own)
            gated = GATES[type(router).__name__](router, logits, experts).to(weights.dtype)
            return logits, torch.where(known[:, None], gated, weights), experts

        return forward


def route_gap_metrics(
    own: torch.Tensor, replayed: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, tally: RouteTally
) -> dict[str, float]:
    """The mismatch with and without replay over the policy tokens (`mask`): mean |log π − log π_behav|
    and the standard deviation of the importance weight w = exp(log π − log π_behav), under the
    trainer's own routes (`own`) and the rollout's (`replayed`); plus the routing agreement."""
    m = mask.bool()
    out = {"route_agreement": tally.agreement, "route_token_layers": float(tally.recorded)}
    for name, logp in (("own", own), ("replay", replayed)):
        gap = (logp - behav)[m]
        out[f"abs_dlogp_behav_{name}"] = float(gap.abs().mean()) if gap.numel() else 0.0
        out[f"iw_std_{name}"] = float(gap.exp().std()) if gap.numel() > 1 else 0.0
    return out
