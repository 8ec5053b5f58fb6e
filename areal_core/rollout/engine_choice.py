"""Which engine `rollout.engine` runs a model with, and why: the rollout worker logs it, records it
as its `engine` event (areal_core/events.py) and the report shows it (report/series.py:
engine_choices).

`auto` picks the continuous engine (`continuous_engine.py`) where it implements the architecture
(`static_cache.check_supported`: the Llama family, Phi-3, Qwen2-MoE, Qwen3-MoE, gpt-oss, and
DeepSeek-V3 through `mla_decoder.py`), because there it decodes faster than the torch engine
(docs/benchmarks.md, CPU: on a tiny Qwen3-MoE with 32 rows, 1.4× at equal lengths and 4.7× on
long-tailed lengths; on a tiny DeepSeek-V3, 1.6–2.8× and 6.4×), else the torch engine (the model's
own forward, which serves every architecture); and the torch engine when the run replays the rollout's routing
(`algo.router_replay=rollout`) and the continuous engine records no routes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineChoice:
    """`setting`: rollout.engine as configured; `engine`: the engine that runs; `why`: one sentence."""

    setting: str
    engine: str
    why: str

    def fields(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        return f"rollout.engine={self.setting} runs the {self.engine} engine: {self.why}"


def choose_local_engine(setting: str, model: Any, needs_routes: bool = False) -> EngineChoice:
    """The built-in engine `setting` ("torch", "continuous" or "auto") runs `model` with
    (module docstring); `needs_routes`: the run replays the engine's recorded routes."""
    if setting != "auto":
        return EngineChoice(setting, setting, "named by rollout.engine")
    from areal_core.rollout.static_cache import UnsupportedModel, check_supported

    kind = getattr(getattr(model, "config", None), "model_type", "?")
    try:
        check_supported(model)
    except UnsupportedModel as exc:
        return EngineChoice(setting, "torch", f"the continuous engine does not implement {kind} ({exc})")
    if needs_routes and not _continuous_records_routes():
        return EngineChoice(
            setting,
            "torch",
            "algo.router_replay=rollout replays the routes the engine records, and the continuous engine records none",
        )
    return EngineChoice(
        setting,
        "continuous",
        f"the continuous engine implements {kind} and decodes faster than the torch engine (docs/benchmarks.md)",
    )


def choose_remote_engine(setting: str) -> EngineChoice:
    return EngineChoice(setting, setting, "named by rollout.engine")


def replays_routes(cfg: Any) -> bool:
    """Whether the run replays the rollout's routing (`algo.router_replay=rollout`)."""
    return getattr(getattr(cfg, "algo", None), "router_replay", "none") == "rollout"


def _continuous_records_routes() -> bool:
    from areal_core.rollout.route_recorder import RECORDING_ENGINES

    return "continuous" in RECORDING_ENGINES
