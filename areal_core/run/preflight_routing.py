"""Preflight check of `algo.router_replay` (areal_core/train/router_replay.py), registered with the
model checks of run/preflight.py: `rollout` replays the experts the rollout engine recorded, so it
needs a mixture-of-experts model whose routers the project knows (areal_core/routes.py:
ROUTER_CLASSES) and an engine that records them (rollout/route_recorder.py: RECORDING_ENGINES,
after `auto` is resolved for the model); anything else is refused before any work starts, with
the reason. `none` needs nothing: an MoE's recorded routes then only feed the routing metrics."""

from __future__ import annotations

from areal_core.config import ConfigError
from areal_core.rollout.factory import local_engine_kind
from areal_core.rollout.route_recorder import RECORDING_ENGINES
from areal_core.routes import ROUTER_CLASSES, route_shape
from areal_core.run.preflight import Preflight, preflight

KEY = "config key 'algo.router_replay'"


@preflight("router_replay")
def check_router_replay(ctx: Preflight) -> None:
    cfg = ctx.cfg
    if cfg.algo.router_replay == "none":
        return
    if not ctx.user_model or ctx.model is None:
        what = (
            "a vision-language model" if cfg.model.kind == "vlm" else "the project's tiny dense Qwen2 (no model.path)"
        )
        raise ConfigError(f"{KEY}: rollout needs a mixture-of-experts model, and the run trains {what}")
    shape = route_shape(ctx.model)
    if shape is None:
        raise ConfigError(
            f"{KEY}: rollout needs a mixture-of-experts model; {type(ctx.model).__name__} has no router of "
            f"{', '.join(ROUTER_CLASSES)}: set algo.router_replay=none"
        )
    engine = cfg.rollout.engine if cfg.rollout.engine not in ("auto",) else local_engine_kind("auto", ctx.model)
    if engine not in RECORDING_ENGINES:
        raise ConfigError(
            f"{KEY}: rollout replays the routes the engine records, and the {engine} engine records none "
            f"(engines that do: {', '.join(RECORDING_ENGINES)}); set rollout.engine=torch or algo.router_replay=none"
        )
    ctx.notes["router_replay"] = (
        f"the {engine} engine records {shape.layers} MoE layers × top-{shape.top_k} of {shape.experts} experts"
    )
