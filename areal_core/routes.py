"""Which experts a mixture-of-experts model chose: found on the model, recorded during a forward,
and stored as one compact column of the trajectory protocol (`protocol.py`, column `routes`).

A sample's routes are an integer array R of shape [tokens, moe_layers, k]: R[t, l] holds the k
expert ids that MoE layer l (the model's routers in module order) chose for input position t,
in the router's own order. Positions no recorded forward computed (the last token, which no
forward reads; a prompt that came from another forward; rows of an engine that records nothing)
hold NOT_RECORDED in every slot. Ids are uint8 when the model has at most 255 experts, else
uint16; the sentinel is the dtype's largest value.

Stored as the Arrow struct ROUTES_TYPE {ids: large_binary (R's bytes, C order), layers, top_k,
itemsize}; the tokens are the row's `input_ids` length, so `len(ids) = tokens·layers·top_k·itemsize`
is checked before a byte is interpreted (`decode_routes`).

Routers are found by class (ROUTER_CLASSES: transformers' top-k routers, each returning
`(router_logits, top_k_weights, top_k_index)`): Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

ROUTES_TYPE = pa.struct(
    [("ids", pa.large_binary()), ("layers", pa.int32()), ("top_k", pa.int32()), ("itemsize", pa.int8())]
)
ROUTER_CLASSES = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "MixtralTopKRouter",
    "DeepseekV3TopkRouter",
    "GptOssTopKRouter",
)
MAX_LAYERS = 1024
MAX_TOP_K = 64
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype("<u2")}


def not_recorded(dtype: np.dtype) -> int:
    """The sentinel of `dtype`: its largest value (no model has that many experts)."""
    return int(np.iinfo(dtype).max)


def id_dtype(num_experts: int) -> np.dtype:
    """uint8 for at most 255 experts (255 is the sentinel), else little-endian uint16."""
    return DTYPES[1] if num_experts < 255 else DTYPES[2]


@dataclass(frozen=True)
class RouteShape:
    """A model's routing: MoE layers, experts chosen per token (k), experts per layer."""

    layers: int
    top_k: int
    experts: int


def moe_routers(model: Any) -> list[Any]:
    """The model's top-k router modules, in module (layer) order; [] for a dense model."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def route_shape(model: Any) -> RouteShape | None:
    """The model's RouteShape, None for a dense model (or routers that differ in k or experts)."""
    routers = moe_routers(model)
    if not routers:
        return None
    ks, es = {int(r.top_k) for r in routers}, {int(r.num_experts) for r in routers}
    if len(ks) != 1 or len(es) != 1:
        return None
    return RouteShape(len(routers), ks.pop(), es.pop())


def encode_routes(routes: np.ndarray | None) -> dict[str, Any] | None:
    """A [tokens, layers, k] uint8/uint16 array as a ROUTES_TYPE value (None stays None)."""
    if routes is None:
        return None
    if routes.ndim != 3 or routes.dtype.itemsize not in DTYPES or routes.dtype.kind != "u":
        raise ValueError(f"routes must be a [tokens, layers, k] uint8/uint16 array, got {routes.dtype}{routes.shape}")
    data = np.ascontiguousarray(routes, dtype=DTYPES[routes.dtype.itemsize]).tobytes()
    return {"ids": data, "layers": routes.shape[1], "top_k": routes.shape[2], "itemsize": routes.dtype.itemsize}


def decode_routes(value: dict[str, Any] | None, tokens: int) -> np.ndarray | None:
    """The [tokens, layers, k] array of a ROUTES_TYPE value; ValueError when its fields are out of
    bounds or its bytes are not exactly tokens·layers·k·itemsize."""
    if value is None:
        return None
    layers, top_k, itemsize, data = value.get("layers"), value.get("top_k"), value.get("itemsize"), value.get("ids")
    if itemsize not in DTYPES or data is None:
        raise ValueError(f"routes with itemsize {itemsize!r} (1 or 2) or without ids")
    if not (
        isinstance(layers, int) and 1 <= layers <= MAX_LAYERS and isinstance(top_k, int) and 1 <= top_k <= MAX_TOP_K
    ):
        raise ValueError(f"routes of {layers} layers and top-k {top_k} (at most {MAX_LAYERS} and {MAX_TOP_K})")
    if len(data) != tokens * layers * top_k * itemsize:
        raise ValueError(f"routes of {len(data)} bytes for {tokens} tokens × {layers} layers × {top_k} × {itemsize}")
    return np.frombuffer(data, dtype=DTYPES[itemsize]).reshape(tokens, layers, top_k).copy()


def routes_problem(routes: np.ndarray, shape: RouteShape) -> str | None:
    """Why `routes` cannot be a route record of a model of `shape` (None when it can): another
    number of MoE layers or k, or an expert id outside [0, experts) other than the sentinel."""
    if routes.shape[1:] != (shape.layers, shape.top_k):
        theirs, ours = f"{routes.shape[1]} × top-{routes.shape[2]}", f"{shape.layers} × top-{shape.top_k}"
        return f"routes of {theirs} (MoE layers × k), the model has {ours}"
    ids = routes[routes != not_recorded(routes.dtype)]
    if ids.size and int(ids.max()) >= shape.experts:
        return f"a routed expert id {int(ids.max())} outside [0, {shape.experts})"
    return None


def cut_routes(routes: np.ndarray | None, tokens: int) -> np.ndarray | None:
    """The routes of a sample cut to its first `tokens` positions, the new last one not recorded
    (no forward reads the last token of a sample)."""
    if routes is None:
        return None
    out = routes[:tokens].copy()
    if len(out):
        out[-1] = not_recorded(out.dtype)
    return out
