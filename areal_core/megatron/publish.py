"""Publication of a tensor-parallel Megatron model: gather the TP shards to an HF state dict on
the TP group's first rank (`shard.gather_hf_state_dict`) and publish it through `weights/`
exactly as the HF trainer does (model.safetensors + side files, MANIFEST.json, LATEST), so the
rollout engines load a Megatron-trained version unchanged: the published bytes equal those of
`weights.publisher.state_dict_bytes` for the same weights (tests/test_megatron_publish.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

from areal_core.megatron.shapes import ModelShape
from areal_core.megatron.shard import gather_hf_state_dict
from areal_core.store import Store
from areal_core.weights.publisher import publish


def hf_weights_bytes(hf: dict[str, torch.Tensor]) -> bytes:
    """model.safetensors of an HF state dict (from `convert.megatron_to_hf`: no tied lm_head)."""
    return st_save({k: v.detach().contiguous().cpu() for k, v in hf.items()}, metadata={"format": "pt"})


def publish_from_shards(
    store: Store,
    version: int,
    local: dict[str, torch.Tensor | None],
    shape: ModelShape,
    side_files: dict[str, bytes],
    group: dist.ProcessGroup | None = None,
) -> float | None:
    """Collective over the TP `group`: every rank gives its model's state dict; the first rank
    publishes weights/v{version}/ and returns the seconds publish took, the others None."""
    hf = gather_hf_state_dict(local, shape, group)
    if hf is None:
        return None
    return publish(store, version, hf_weights_bytes(hf), side_files)
