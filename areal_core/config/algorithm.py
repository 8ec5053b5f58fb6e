"""An RL algorithm as configuration (`algo.*`): advantage estimator + normalisation + aggregation
+ loss, and the named presets. The tensor code that reads it is areal_core/train/algorithm.py.

    cfg = from_preset("dapo", eps_high=0.3)      # validated; ConfigError names 'algo.<key>'

A preset is a file configs/algorithms/<name>.yaml (its `algo:` section); `PRESETS` reads them all.
`algo.loss` is the name of a loss in the registry, areal_core/train/loss/, a layer above this
one, so this model only checks that it is a string: `areal_core.train.loss.check_algorithm`
validates it against the registry (a ConfigError naming the registered losses); `required_inputs`
and `train_step` call it first, and so should whatever loads a config before starting work.

This model holds what every loss shares. A loss's own hyperparameters are declared by its module
(a pydantic model registered with the loss) and given under its name, `algo.<loss>.<key>`
(`algo.sapo.tau_pos: 1.0`): this layer keeps each such mapping as given (`section`), and
`check_algorithm` validates it against the loss's model at prepare. The flat keys they replaced
(`algo.sapo_tau_pos`) are read for one more release (config/moved_keys.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal, Self, get_args

from pydantic import ConfigDict, Field, field_validator, model_validator

from areal_core.config.base import (
    PROJECT_ROOT,
    Bool,
    ConfigError,
    ConfigModel,
    Float,
    Int,
    Invalid,
    Str,
    Unknown,
    read_yaml_file,
)
from areal_core.config.moved_keys import move_flat_keys

AdvEstimator = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "lite_ppo",
    "gae",
    "batch_norm",  # AReaL's paper: reward normalised over the batch's policy tokens, no group baseline
    "group_batch_norm",  # AReaL's GSM8K example: group mean/std, then batch mean/std
]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
BehavCorrection = Literal["none", "truncate", "mask"]
BehavLevel = Literal["token", "sequence", "geometric"]
KlEstimator = Literal["k1", "k2", "k3"]
RouterReplay = Literal["none", "rollout"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
BEHAV_CORRECTIONS: tuple[str, ...] = get_args(BehavCorrection)
BEHAV_LEVELS: tuple[str, ...] = get_args(BehavLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)


class AlgorithmConfig(ConfigModel):
    """What every loss shares. A loss's own settings are a mapping under its name, `algo.<loss>.<key>`
    (`algo.sapo.tau_pos`), kept here as given (`section`) and validated at prepare by the settings model
    the loss registers (areal_core/train/loss/registry.py `check_settings`); any other unknown key is refused.

    Each key here is read by more than one loss, or by the step around every loss: `eps_low`/`eps_high` by the
    four clipped-surrogate losses (decoupled_ppo, ppo, gspo, gspo_token) and cispo; `dual_clip` by those four
    (they share `decoupled_ppo_loss`); the behaviour correction, aggregation and regularisers by all. A knob of
    one loss alone lives in its section (`algo.decoupled_ppo.behav_clip_drop`, once `algo.behav_clip_drop`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    # advantages
    adv_estimator: AdvEstimator = "grpo"
    adv_whiten: Bool = False  # extra masked batch whitening of token advantages (PPO with critic)
    adv_clip: Float = Field(0.0, ge=0)  # clamp |A| to this; 0 disables
    gamma: Float = Field(1.0, gt=0, le=1)  # discount (reinforce_pp*, gae)
    lam: Float = Field(1.0, ge=0, le=1)  # GAE λ
    # policy loss
    loss: Str = "decoupled_ppo"  # a registered loss (areal_core/train/loss/; checked by check_algorithm)
    aggregation: Aggregation = "token_mean"
    norm_const: Float = Field(0.0, ge=0)  # Dr.GRPO constant C in tokens (0: longest response in the batch)
    eps_low: Float = Field(0.2, ge=0, lt=1)
    eps_high: Float = Field(0.28, ge=0)  # DAPO clip-higher
    dual_clip: Float = Field(0.0, ge=0)  # 0 disables; else c > 1
    # behaviour-policy correction w = π_prox/π_behav
    behav_correction: BehavCorrection = "truncate"  # mask: IcePop
    behav_low: Float = Field(0.0, ge=0)  # mask: lower bound on w (0: none)
    behav_high: Float = Field(5.0, ge=0)  # truncate: cap on w; mask: upper bound (0: none)
    behav_level: BehavLevel = "token"
    # regularisers
    kl_coef: Float = Field(0.0, ge=0)  # β for KL(π_θ‖π_ref); needs reference log-probs when > 0
    kl_estimator: KlEstimator = "k3"
    kl_as_reward: Bool = False  # True: −β·KL shapes the reward; False: +β·KL is a loss term
    entropy_coef: Float = Field(0.0, ge=0)  # loss −= coef · entropy
    # mixture of experts (areal_core/train/router_replay.py): rollout forces the engine's recorded experts on the
    # π_θ and π_prox forwards, the gate weights recomputed under the trainer's router (R3); checked at prepare
    router_replay: RouterReplay = "none"
    # per step, when samples carry routes: routing agreement and |Δ log p| with and without replay (no-grad forwards)
    route_metrics: Bool = True
    # data shaping
    dynamic_sampling: Bool = False  # DAPO: drop groups whose rewards are all equal
    overlong_max_len: Int = Field(0, ge=0)  # DAPO L_max in response tokens; 0 disables the overlong penalty
    overlong_buffer: Int = Field(0, ge=0)  # DAPO L_cache
    overlong_penalty: Float = Field(1.0, ge=0)  # penalty factor
    reward_scale: Float = 1.0
    reward_bias: Float = 0.0
    reward_clip: Float = Field(0.0, ge=0)  # 0 disables

    @model_validator(mode="before")
    @classmethod
    def _moved_flat_keys(cls, data: Any) -> Any:
        return move_flat_keys(data)  # the previous release's flat keys (config/moved_keys.py)

    @model_validator(mode="after")
    def _loss_sections(self) -> Self:
        for name, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                raise Unknown(name, " (a loss's settings are a mapping, algo.<loss name>.<key>)")
            if not name.isidentifier() or not all(isinstance(k, str) and k.isidentifier() for k in value):
                raise Invalid(name, "must be a loss's name holding its settings' names (identifiers)")
        return self

    def section(self, name: str) -> dict[str, Any]:
        """The settings given under `algo.<name>` (a loss's name), unvalidated; {} when none are."""
        return dict((self.model_extra or {}).get(name) or {})

    def sections(self) -> list[str]:
        """The names of the `algo.<name>` sections set (each a loss's settings)."""
        return sorted(self.model_extra or {})

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_off_or_above_one(cls, value: float) -> float:
        if value and value <= 1:
            raise ValueError(f"must be 0 (off) or > 1, got {value}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Self:
        if self.behav_correction == "mask" and self.behav_high and self.behav_low >= self.behav_high:
            raise Invalid("behav_low", "must be < behav_high for masking")
        if self.overlong_buffer > self.overlong_max_len:
            raise Invalid("overlong_buffer", "must be <= overlong_max_len")
        return self


PRESET_DIR = PROJECT_ROOT / "configs" / "algorithms"


@functools.cache
def presets(folder: Path = PRESET_DIR) -> dict[str, dict[str, Any]]:
    """name -> the `algo:` overrides of configs/algorithms/<name>.yaml, for every file there."""
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        data = read_yaml_file(path, "algorithm preset")
        if not isinstance(data, dict) or set(data) - {"algo"}:
            raise ConfigError(f"algorithm preset file '{path}' must hold one `algo:` section")
        out[path.stem] = data.get("algo") or {}
    return out


def __getattr__(name: str) -> Any:
    if name == "PRESETS":  # read on first use, not at import
        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """AlgorithmConfig of a named preset, with keyword overrides laid over it (a loss's section key by
    key: `from_preset("sapo", sapo={"tau_neg": 2.0})`); validated (ConfigError)."""
    known = presets()
    if name not in known:
        raise ConfigError(f"unknown algorithm preset {name!r}; expected one of {sorted(known)}")
    preset = move_flat_keys(known[name])
    loss = preset.get("loss", AlgorithmConfig.model_fields["loss"].default)
    overrides = move_flat_keys({"loss": loss, **overrides}, keep_defaults=True)
    merged = {**preset, **overrides}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(preset.get(key), dict):
            merged[key] = {**preset[key], **value}
    return AlgorithmConfig.from_data(merged, prefix="algo")
