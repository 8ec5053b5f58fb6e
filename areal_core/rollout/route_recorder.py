"""Recording an MoE engine's routing (areal_core/routes.py: what a record is).

`RouteRecorder(model)` holds a forward hook on each of the model's routers while it is entered;
every router returns `(router_logits, top_k_weights, top_k_index)`, and the hook keeps the index
of the last call. `take()` gives the last forward's choices as [tokens, moe_layers, k], tokens in
the order the model flattened them (row-major over [batch, positions]).

`RouteBuffer` (the torch engine) places them in a static batch's padded coordinates [rows, width, layers, k] (on the
host: one small copy per decode step) and cuts each row's routes out at the end. A position
computed again (a re-prefill after a weight swap) keeps the choices of its latest forward: the
routes the later tokens were sampled under. `RequestRoutes` does the same for the continuous
engine, whose decoder reports each MoE layer's choice (moe_block.route) pass by pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from areal_core.routes import RouteShape, id_dtype, moe_routers, not_recorded, route_shape

RECORDING_ENGINES = (
    "torch",
    "continuous",
)  # the built-in engines whose Generations carry routes (algo.router_replay=rollout)


class RouteRecorder:
    """Forward hooks on `model`'s routers while entered; `shape` is None for a dense model."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.shape: RouteShape | None = route_shape(model)
        self._last: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        if self.shape is not None:
            for layer, router in enumerate(self.routers):
                self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last.clear()

    def _hook(self, layer: int):
        def keep(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self._last[layer] = output[2].detach()

        return keep

    def take(self) -> torch.Tensor | None:
        """[tokens, layers, k] expert ids of the last forward (int64, on the host), then forgotten;
        None for a dense model or when a router did not run."""
        if self.shape is None or len(self._last) != self.shape.layers:
            self._last.clear()
            return None
        out = torch.stack([self._last[i] for i in range(self.shape.layers)], dim=1).cpu()
        self._last.clear()
        return out


class RouteBuffer:
    """A static batch's routes in padded coordinates: [rows, width, layers, k], NOT_RECORDED until written."""

    def __init__(self, shape: RouteShape, rows: int, width: int):
        self.dtype = id_dtype(shape.experts)
        self.sentinel = not_recorded(self.dtype)
        self.data = np.full((rows, width, shape.layers, shape.top_k), self.sentinel, dtype=self.dtype)

    def write(self, choices: torch.Tensor | None, start: int, rows: int, positions: int) -> None:
        """The [rows·positions, layers, k] choices of a forward over columns [start, start + positions)."""
        if choices is None:
            return
        block = choices.view(rows, positions, *choices.shape[1:]).numpy().astype(self.dtype)
        self.data[:, start : start + positions] = block

    def row(self, i: int, first: int, stop: int) -> np.ndarray:
        """Row i's routes over columns [first, stop), its last position not recorded (no forward reads it)."""
        out = self.data[i, first:stop].copy()
        if len(out):
            out[-1] = self.sentinel
        return out


class RequestRoutes:
    """The continuous engine's routes, one [prompt + max_new, layers, k] buffer per request, filled
    from its passes: the decoder calls `collect(layer, ids)` with each MoE layer's [tokens, k] choice
    (`static_cache.StaticCacheDecoder.on_route`); after a pass the engine says which request and
    position each token was (`prefill`, `decode`), and copies a shared prompt's rows (`copy`)."""

    def __init__(self, shape: RouteShape, lengths: list[int]):
        self.dtype = id_dtype(shape.experts)
        self.sentinel = not_recorded(self.dtype)
        self.data = [np.full((n, shape.layers, shape.top_k), self.sentinel, dtype=self.dtype) for n in lengths]
        self._pass: dict[int, torch.Tensor] = {}

    def collect(self, layer: int, ids: torch.Tensor) -> None:
        self._pass[layer] = ids.detach()

    def _take(self) -> np.ndarray:
        """[tokens, layers, k] of the last pass, MoE layers in decoder order."""
        out = torch.stack([self._pass[i] for i in sorted(self._pass)], dim=1).cpu().numpy().astype(self.dtype)
        self._pass.clear()
        return out

    def prefill(self, requests: list[int], lengths: list[int], width: int) -> None:
        """A prefill pass over right-padded rows of `width` positions: request r's first lengths[r]."""
        block = self._take().reshape(len(requests), width, *self.data[0].shape[1:])
        for k, (r, n) in enumerate(zip(requests, lengths)):
            self.data[r][:n] = block[k, :n]

    def decode(self, requests: list[int], positions: list[int]) -> None:
        """A decode pass: one token per row, request requests[i] at positions[i]."""
        block = self._take()
        for i, (r, p) in enumerate(zip(requests, positions)):
            self.data[r][p] = block[i]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Request dst's first `length` positions were copied from src's cache (a shared prompt)."""
        self.data[dst][:length] = self.data[src][:length]

    def routes(self, request: int, tokens: int) -> np.ndarray:
        """The request's routes over its `tokens` (prompt + generated), the last one not recorded."""
        out = self.data[request][:tokens].copy()
        if len(out):
            out[-1] = self.sentinel
        return out
