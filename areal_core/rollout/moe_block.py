"""The mixture-of-experts MLP of the continuous engine's decoder (`static_cache.py`): Qwen2-MoE and
Qwen3-MoE sparse blocks, read from the `transformers` model's own weights.

For the tokens x_t of a pass (every row of a decode step, or every position of a prefill chunk):

    p_t      = softmax(W_r · x_t)                         (float32, as transformers computes it)
    E_t, w_t = the top-k experts of p_t and their p (÷ Σ of the k when norm_topk_prob)
    y_t      = Σ_{e ∈ E_t} w_{t,e} · W_down[e] · (silu(W_gate[e] · x_t) ⊙ W_up[e] · x_t)
             + σ(w_sg · x_t) · W_down_s · (silu(W_gate_s · x_t) ⊙ W_up_s · x_t)     (Qwen2-MoE's shared expert)

The k·T (token, expert) pairs are sorted by expert id and each expert's tokens go through one GEMM,
all experts in one grouped matmul (`torch.nn.functional.grouped_mm` where this device and dtype
run it, else one `linear` per expert): the experts are batched across the rows of a step, never
looped per row. `route` is the one place experts are chosen (routing records hook it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


@dataclass
class Router:
    """A top-k softmax router: `weight` [E, hidden]; `normalize` is the config's norm_topk_prob."""

    weight: torch.Tensor
    top_k: int
    normalize: bool


@dataclass
class MoeMlp:
    """The weights of one sparse block, views of the model's parameters (`gate_up` [E, 2I, hidden]:
    gate rows first; `down` [E, hidden, I]) but for the shared expert's fused gate|up, a copy
    refreshed by `static_cache.StaticCacheDecoder.refresh`."""

    layer: int
    router: Router
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_gate_up: torch.Tensor | None = None  # [2·I_s, hidden]
    shared_down: torch.Tensor | None = None  # [hidden, I_s]
    shared_gate: torch.Tensor | None = None  # [1, hidden]: σ(w_sg · x) scales the shared expert


def route(hidden: torch.Tensor, gate: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k]) of tokens `hidden` [T, hidden]: p = softmax(W_r · h)
    in float32, its k largest entries, divided by their sum when `gate.normalize`; the weights in
    hidden's dtype (transformers' Qwen2MoeTopKRouter / Qwen3MoeTopKRouter)."""
    probs = torch.softmax(F.linear(hidden, gate.weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, gate.top_k, dim=-1)
    if gate.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(hidden.dtype)


def moe_mlp_into(
    block: MoeMlp, x: torch.Tensor, normed: torch.Tensor, on_route: Callable[[int, torch.Tensor], None] | None = None
) -> torch.Tensor:
    """x + y: the block's output y (module docstring) for `normed` = n(x) [T, hidden], added to the residual x.
    `on_route(layer, topk_ids)`: told the experts chosen (a routing record: rollout/route_recorder.py)."""
    ids, weights = route(normed, block.router)
    if on_route is not None:
        on_route(block.layer, ids)
    if block.shared_gate_up is None:
        out = x.clone()
    else:
        g, u = F.linear(normed, block.shared_gate_up).chunk(2, dim=-1)
        shared = torch.mm(F.silu(g).mul_(u), block.shared_down.t())
        out = torch.addcmul(x, torch.sigmoid(F.linear(normed, block.shared_gate)), shared)
    return grouped_experts_into(out, normed, ids, weights, block.gate_up, block.down)


def grouped_experts_into(
    out: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """out[t] += Σ_j weights[t, j] · down[e] · (silu(gate[e] · x_t) ⊙ up[e] · x_t), e = ids[t, j]; in place.

    The T·k pairs are sorted by expert (stable), so expert e's tokens are the rows offs[e−1]..offs[e]
    of the gathered input and one grouped GEMM per weight computes every expert over its own rows."""
    _, order, token, offs = expert_order(ids, gate_up.shape[0])
    g, u = grouped_linear(x.index_select(0, token), gate_up, offs).chunk(2, dim=-1)
    y = grouped_linear(F.silu(g).mul_(u), down, offs)
    y.mul_(weights.reshape(-1).index_select(0, order)[:, None])
    return out.index_add_(0, token, y)


def expert_order(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    """(by_expert, order, token, offs) of the T·k (token, expert) pairs `ids` [T, k] sorted by expert
    (stable): pair j is ids.flatten()[order[j]] = by_expert[j], of token token[j]; offs[e] is the
    end of expert e's rows (int32, as `grouped_linear` takes it)."""
    by_expert, order = torch.sort(ids.reshape(-1), stable=True)
    every = torch.arange(experts, device=ids.device, dtype=by_expert.dtype)
    offs = torch.searchsorted(by_expert, every, right=True).to(torch.int32)
    return by_expert, order, order // ids.shape[1], offs


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e−1]..offs[e] of `x` [S, in] times w[e]ᵀ (`w` [E, out, in]): [S, out]."""
    if grouped_mm_runs(x.device, x.dtype):
        try:
            return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError):  # a shape or stride this kernel refuses: per expert from now on
            _GROUPED_MM_OK[(str(x.device), x.dtype)] = False
    ends = offs.tolist()
    parts = [F.linear(x[a:b], w[e]) for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)) if b > a]
    return torch.cat(parts) if parts else x.new_empty(0, w.shape[1])


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` runs on `device` in `dtype` and equals the per-expert matmuls (tried once)."""
    key = (str(device), dtype)
    if key not in _GROUPED_MM_OK:
        ok = hasattr(F, "grouped_mm")
        if ok:
            x = torch.arange(48, device=device, dtype=torch.float32).reshape(3, 16).div_(48).to(dtype)
            w = torch.ones(2, 8, 16, device=device, dtype=dtype)
            offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
            try:
                got = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
                ok = torch.allclose(got.float(), (x @ w[0].t()).float(), rtol=1e-2, atol=1e-2)
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


def read_moe(mlp: torch.nn.Module, layer: int) -> MoeMlp | None:
    """Layer `layer`'s MLP as a MoeMlp; None for a dense one (Qwen-MoE's mlp_only_layers and the
    layers decoder_sparse_step skips hold a plain gated MLP)."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return None
    gate, shared = mlp.gate, getattr(mlp, "shared_expert", None)
    router = Router(gate.weight, int(gate.top_k), bool(gate.norm_topk_prob))
    block = MoeMlp(layer, router, experts.gate_up_proj, experts.down_proj)
    if shared is not None:
        block.shared_gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        block.shared_down = shared.down_proj.weight
        block.shared_gate = mlp.shared_expert_gate.weight
    return block


def unsupported_moe(model: torch.nn.Module) -> str | None:
    """What this block would compute differently from the model's sparse blocks (None: nothing)."""
    for i, blk in enumerate(model.model.layers):
        experts = getattr(blk.mlp, "experts", None)
        if experts is None:
            continue
        layout = {k: getattr(experts, k, d) for k, d in (("is_transposed", False), ("is_concatenated", True))}
        if getattr(experts, "has_bias", False) or layout != {"is_transposed": False, "is_concatenated": True}:
            return f"layer {i}'s experts are not [E, 2I, hidden] gate|up and [E, hidden, I] down without biases"
        if experts.gate_up_proj.dim() != 3 or not all(hasattr(blk.mlp.gate, k) for k in ("top_k", "norm_topk_prob")):
            return f"layer {i}'s sparse block is not a top-k softmax router over fused 3D experts"
        shared = getattr(blk.mlp, "shared_expert", None)
        if shared is not None and not hasattr(blk.mlp, "shared_expert_gate"):
            return f"layer {i}'s shared expert has no sigmoid gate"
    return None
