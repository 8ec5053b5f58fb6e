"""HF ⇄ Megatron state dicts for Qwen3-MoE, and the expert-parallel (EP) split; pure torch.

Megatron-core's MoE layer with the local spec (`get_gpt_layer_local_spec(num_experts=E,
qk_layernorm=True)`, megatron-core 0.16.1) holds, per decoder layer:

| Megatron | HF (Qwen3-MoE, transformers 5) |
|---|---|
| `self_attention.q_layernorm.weight`, `k_layernorm.weight` | `self_attn.q_norm.weight`, `k_norm.weight` |
| `mlp.router.weight` [E, hidden] | `mlp.gate.weight` |
| `mlp.experts.local_experts.j.linear_fc1.weight` [2I, hidden] | `mlp.experts.gate_up_proj[e]` (`[gate; up]`, as fc1) |
| `mlp.experts.local_experts.j.linear_fc2.weight` [hidden, I] | `mlp.experts.down_proj[e]` |

Everything else is the dense layout (`convert.py`). Under expert parallelism EP, rank r of the EP
group holds the global experts e = r·E/EP + j as its local experts j = 0 … E/EP − 1
(megatron/core/transformer/moe/experts.py, `SequentialMLP`); the router and every non-expert
tensor are replicated. Every tensor is copied, never changed: HF → Megatron → EP shards → HF is
byte-exact (tests/test_megatron_moe.py).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from areal_core.megatron.convert import hf_to_megatron, megatron_to_hf
from areal_core.megatron.shapes import ModelShape, shape_from_hf_config

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_QK_NORMS = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),)
_QK_NORMS += (("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),)


@dataclass
class MoeShape:
    """The routed-expert part of a Qwen3-MoE config: E experts of width I, top-k routing."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def moe_shape_from_hf_config(hf: Any) -> tuple[ModelShape, MoeShape]:
    """(dense shape, expert shape) of a Qwen3-MoE config (object or config.json dict). Refuses
    dense layers between sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1): not mapped."""
    get = hf.get if isinstance(hf, dict) else lambda k, d=None: getattr(hf, k, d)
    if get("model_type") != "qwen3_moe":
        raise ValueError(f"the MoE converter maps qwen3_moe only, not {get('model_type')!r}")
    if get("mlp_only_layers") or (get("decoder_sparse_step") or 1) != 1:
        raise ValueError("dense MLP layers among the sparse ones (mlp_only_layers, decoder_sparse_step): not mapped")
    experts = get("num_experts") or get("num_local_experts")
    moe = MoeShape(experts, get("num_experts_per_tok"), get("moe_intermediate_size"), bool(get("norm_topk_prob")))
    return shape_from_hf_config(hf), moe


def moe_config_kwargs(moe: MoeShape, expert_parallel: int) -> dict[str, Any]:
    """TransformerConfig arguments beyond `shapes.transformer_config_kwargs` for Qwen3-MoE: HF's
    router is softmax over all E experts, then top-k (renormalised over the k when norm_topk_prob),
    so `moe_router_pre_softmax` is set unless norm_topk_prob (top-k then softmax over the k is the
    same thing); no load-balancing loss in the forward; the all-gather token dispatcher."""
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.moe_intermediate_size,
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": expert_parallel,
        "qk_layernorm": True,
    }


def qwen3_moe_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape, moe: MoeShape) -> dict[str, torch.Tensor]:
    """An HF Qwen3-MoE state dict → Megatron GPTModel's (TP = 1, EP = 1): the qk norms, router
    and experts here, the rest by `convert.hf_to_megatron` (which refuses any key left over)."""
    left, out = dict(hf), {}
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _QK_NORMS:
            out[m + mg_name] = left.pop(h + hf_name)
        out[m + "mlp.router.weight"] = left.pop(h + "mlp.gate.weight")
        fc1, fc2 = left.pop(h + "mlp.experts.gate_up_proj"), left.pop(h + "mlp.experts.down_proj")
        if fc1.shape[0] != moe.num_experts or fc1.shape[1] != 2 * moe.moe_intermediate_size:
            raise ValueError(f"{h}mlp.experts.gate_up_proj has shape {tuple(fc1.shape)}, not [E, 2I, hidden]")
        for e in range(moe.num_experts):
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e].clone()
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e].clone()
    return {**hf_to_megatron(left, shape), **out}


def megatron_to_qwen3_moe(mg: dict[str, torch.Tensor], shape: ModelShape, moe: MoeShape) -> dict[str, torch.Tensor]:
    """Megatron GPTModel's state dict (EP = 1: `unshard_experts` first) → HF Qwen3-MoE's."""
    left = {k: v for k, v in mg.items() if not k.endswith("._extra_state")}
    out: dict[str, torch.Tensor] = {}
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _QK_NORMS:
            out[h + hf_name] = left.pop(m + mg_name)
        out[h + "mlp.gate.weight"] = left.pop(m + "mlp.router.weight")
        experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(moe.num_experts)]
        out[h + "mlp.experts.gate_up_proj"] = torch.stack([left.pop(x + "linear_fc1.weight") for x in experts])
        out[h + "mlp.experts.down_proj"] = torch.stack([left.pop(x + "linear_fc2.weight") for x in experts])
    return {**megatron_to_hf(left, shape), **out}


def shard_experts(mg: dict[str, torch.Tensor], ep: int, rank: int, moe: MoeShape) -> dict[str, torch.Tensor]:
    """EP rank `rank`'s part: its E/EP experts renumbered from 0 (global e = rank·E/EP + j), every
    other tensor replicated."""
    if moe.num_experts % ep:
        raise ValueError(f"expert parallel {ep} must divide num_experts={moe.num_experts}")
    per = moe.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for key, t in mg.items():
        found = _EXPERT.match(key)
        if found is None:
            out[key] = t
        elif rank * per <= int(found[2]) < (rank + 1) * per:
            out[f"{found[1]}{int(found[2]) - rank * per}{found[3]}"] = t
    return out


def unshard_experts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The EP = 1 state dict from every EP rank's (in rank order): local expert j of rank r is
    global expert r·(E/EP) + j. The replicated tensors must be equal on every rank."""
    per = 1 + max(int(m[2]) for m in map(_EXPERT.match, parts[0]) if m is not None)
    out: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for key, t in part.items():
            if key.endswith("._extra_state"):
                continue
            found = _EXPERT.match(key)
            if found is not None:
                out[f"{found[1]}{rank * per + int(found[2])}{found[3]}"] = t
            elif key in out and not torch.equal(out[key], t):
                raise ValueError(f"{key} differs between EP ranks 0 and {rank}")
            else:
                out[key] = t
    return out


def ep_case(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """The input of `python -m areal_core.megatron.ep_check` for an HF Qwen3-MoE model: its
    converted state dict, its logits on `ids`, and layer 0's sparse MoE block input and output."""
    shape, moe = moe_shape_from_hf_config(model.config)
    seen: dict[str, torch.Tensor] = {}

    def keep(_mod: torch.nn.Module, args: tuple, out: Any) -> None:
        seen["in"], seen["out"] = args[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone()

    hook = model.model.layers[0].mlp.register_forward_hook(keep)
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        hook.remove()
    mg = qwen3_moe_to_megatron(model.state_dict(), shape, moe)
    case = {"shape": shape.as_dict(), "moe": moe.as_dict(), "megatron": mg, "ids": ids, "hf_logits": logits}
    return case | {"moe_input": seen["in"], "hf_moe_output": seen["out"]}
