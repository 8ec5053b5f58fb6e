"""How a run is operated rather than what it trains: MLflow tracking, the single-machine
launcher, the run root's ownership lease and the online promotion gate."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from areal_core.config.base import MAX_WAIT_S, Bool, ConfigModel, Float, Int, Invalid, Str


class TrackingConfig(ConfigModel):
    enabled: Bool = Field(True, description="log to MLflow")
    uri: Str = Field("", description="MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns.db")
    experiment: Str = Field("areal-flyte", description="MLflow experiment name")


class LauncherConfig(ConfigModel):
    timeout_s: Float = Field(
        1800.0, gt=0, le=MAX_WAIT_S, description="single machine: seconds before the roles are stopped"
    )
    progress: Bool = Field(True, description="single machine: print a progress line")
    report_every_s: Float = Field(
        60.0,
        ge=0,
        description="single machine: seconds between refreshes of the live report (the Flyte Deck); 0: at the end only",
    )


class LeaseConfig(ConfigModel):
    """The run root's ownership lease (areal_core/run/ownership.py)."""

    timeout_s: Float = Field(300.0, gt=0, le=MAX_WAIT_S, description="a lease not renewed for this long is stale")
    interval_s: Float = Field(5.0, gt=0, description="how often the roles check the lease (and the trainer renews it)")
    takeover: Bool = Field(
        False, description="take over a stale lease of another run (never a live one); not kept in config.yaml"
    )

    @model_validator(mode="after")
    def _renewed_in_time(self) -> Self:
        if self.interval_s * 2 > self.timeout_s:
            raise Invalid("interval_s", f"must be at most half of timeout_s ({self.timeout_s:g})")
        return self


class OnlineConfig(ConfigModel):
    promote_every: Int = Field(
        0,
        ge=0,
        description=(
            "continuous online RL: every this many steps, score the trainer's version on the held-out split and "
            "move the registry's champion alias to it only when it wins (online/promotion.py); 0: no gate"
        ),
    )
    model_name: Str = Field("areal-flyte-policy", description="the registered model whose champion the gate moves")
    min_gain: Float = Field(0.0, ge=0, description="a version must beat the champion's held-out score by more")
