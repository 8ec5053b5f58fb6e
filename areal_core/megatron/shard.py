"""Tensor-parallel sharding and unsharding of a Megatron GPTModel state dict; pure torch.

How megatron-core partitions each parameter over TP ranks (megatron/core/tensor_parallel/layers.py):

* column-parallel (rows split in TP contiguous blocks): `linear_qkv` weight and bias (each rank
  holds whole query groups, `num_kv_heads / TP` of them, with their k and v: so TP must divide
  `num_kv_heads`), the vocabulary-parallel `embedding.word_embeddings` and `output_layer`;
* `linear_fc1` is column-parallel over `[gate; up]` *separately*: rank r holds
  `[gate_r; up_r]`, so the TP shards of fc1 concatenated are not the TP = 1 tensor;
* row-parallel (columns split): `linear_proj`, `linear_fc2`; their biases are replicated (added
  once, after the all-reduce);
* replicated: every norm weight.

`gather_hf_state_dict` is the publication path: every TP rank gives its model's state dict, the
group's first rank receives the shards (one `torch.distributed.gather` per tensor) and returns the
HF state dict, the others None.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from areal_core.megatron.convert import megatron_to_hf
from areal_core.megatron.shapes import ModelShape

Rule = Literal["column", "glu", "row", "replicated"]
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_rule(key: str) -> Rule:
    """How megatron-core splits the parameter `key` over tensor-parallel ranks."""
    if key in _VOCAB or key.endswith((".linear_qkv.weight", ".linear_qkv.bias")):
        return "column"
    if key.endswith((".linear_fc1.weight", ".linear_fc1.bias")):
        return "glu"
    if key.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return "row"
    if key.endswith(("layernorm.weight", ".layer_norm_weight", ".linear_proj.bias", ".linear_fc2.bias")):
        return "replicated"
    raise ValueError(f"no tensor-parallel rule for {key!r}")


def _params(sd: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict, without `_extra_state` (Transformer Engine metadata)."""
    return {k: v for k, v in sd.items() if not k.endswith("._extra_state") and isinstance(v, torch.Tensor)}


def _chunk(t: torch.Tensor, tp: int, dim: int, key: str) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % tp:
        raise ValueError(f"{key}: dimension {dim} of size {t.shape[dim]} does not split over {tp} TP ranks")
    return t.chunk(tp, dim=dim)


def check_tp(shape: ModelShape, tp: int) -> None:
    """What the sharding here needs: TP divides the query heads, the KV groups and the FFN."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(shape, name) % tp:
            raise ValueError(f"tensor parallel {tp} must divide {name}={getattr(shape, name)}")


def shard_for_rank(
    sd: dict[str, torch.Tensor], tp: int, rank: int, shape: ModelShape | None = None
) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s part of an unsharded (TP = 1) Megatron state dict; copies, not views."""
    if shape is not None:
        check_tp(shape, tp)
    out: dict[str, torch.Tensor] = {}
    for key, t in _params(sd).items():
        rule = split_rule(key)
        if rule == "column":
            part = _chunk(t, tp, 0, key)[rank]
        elif rule == "row":
            part = _chunk(t, tp, 1, key)[rank]
        elif rule == "glu":
            gate, up = _chunk(t, 2, 0, key)
            part = torch.cat([_chunk(gate, tp, 0, key)[rank], _chunk(up, tp, 0, key)[rank]])
        else:
            part = t
        out[key] = part.clone()
    return out


def shard_state_dict(
    sd: dict[str, torch.Tensor], tp: int, shape: ModelShape | None = None
) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's part of an unsharded Megatron state dict."""
    return [shard_for_rank(sd, tp, rank, shape) for rank in range(tp)]


def unshard_state_dict(
    shards: list[dict[str, torch.Tensor | None]], check_replicated: bool = True
) -> dict[str, torch.Tensor]:
    """The TP = 1 state dict of the TP ranks' state dicts (rank order). A replicated tensor that
    differs across ranks (ranks that drifted apart) raises ValueError when `check_replicated`."""
    parts = [_params(s) for s in shards]
    keys = set(parts[0])
    for rank, p in enumerate(parts[1:], start=1):
        if set(p) != keys:
            raise ValueError(f"TP rank {rank} has other keys than rank 0: {sorted(set(p) ^ keys)[:8]}")
    out: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        ts = [p[key] for p in parts]
        rule = split_rule(key)
        if rule == "column":
            out[key] = torch.cat(ts)
        elif rule == "row":
            out[key] = torch.cat(ts, dim=1)
        elif rule == "glu":
            halves = [t.chunk(2) for t in ts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            if check_replicated and any(not torch.equal(ts[0], t) for t in ts[1:]):
                raise ValueError(f"{key} is replicated over TP ranks but differs between them")
            out[key] = ts[0]
    return out


def gather_tp_shards(
    local: dict[str, torch.Tensor | None], group: dist.ProcessGroup | None = None
) -> list[dict[str, torch.Tensor]] | None:
    """Every TP rank's state dict, on the group's first rank (CPU tensors; None elsewhere).
    Collective: every rank of `group` calls it with the same keys and shapes."""
    world = dist.get_world_size(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    mine = dist.get_rank() == dst
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for key, t in sorted(_params(local).items()):
        t = t.detach().contiguous()
        bucket = [torch.empty_like(t) for _ in range(world)] if mine else None
        dist.gather(t, bucket, dst=dst, group=group)
        if bucket is not None:
            for rank, part in enumerate(bucket):
                shards[rank][key] = part.cpu()
    return shards if mine else None


def gather_hf_state_dict(
    local: dict[str, torch.Tensor | None],
    shape: ModelShape,
    group: dist.ProcessGroup | None = None,
    te_layout: bool = False,
) -> dict[str, torch.Tensor] | None:
    """The HF state dict of a tensor-parallel GPTModel, on the TP group's first rank (None on the
    others): gather the shards, unshard, convert. Collective over `group`."""
    shards = gather_tp_shards(local, group)
    if shards is None:
        return None
    return megatron_to_hf(unshard_state_dict(shards), shape, te_layout=te_layout)
