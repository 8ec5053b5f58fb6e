"""An RL algorithm as configuration (`algo.*`): advantage estimator + normalisation + aggregation
+ loss, and the named presets. The tensor code that reads it is areal_core/train/algorithm.py.

    cfg = from_preset("dapo", eps_high=0.3)      # validated; ConfigError names 'algo.<key>'
"""

from __future__ import annotations

from typing import Any, Literal, Self, get_args

from pydantic import Field, field_validator, model_validator

from areal_core.config.base import Bool, ConfigError, ConfigModel, Float, Int, Invalid

AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "lite_ppo", "gae"]
Loss = Literal["decoupled_ppo", "ppo", "gspo", "gspo_token", "dpo", "ipo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
BehavCorrection = Literal["none", "truncate", "mask"]
BehavLevel = Literal["token", "sequence", "geometric"]
KlEstimator = Literal["k1", "k2", "k3"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
LOSSES: tuple[str, ...] = get_args(Loss)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
BEHAV_CORRECTIONS: tuple[str, ...] = get_args(BehavCorrection)
BEHAV_LEVELS: tuple[str, ...] = get_args(BehavLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)


class AlgorithmConfig(ConfigModel):
    # advantages
    adv_estimator: AdvEstimator = "grpo"
    adv_whiten: Bool = False  # extra masked batch whitening of token advantages (PPO with critic)
    adv_clip: Float = Field(0.0, ge=0)  # clamp |A| to this; 0 disables
    gamma: Float = Field(1.0, gt=0, le=1)  # discount (reinforce_pp*, gae)
    lam: Float = Field(1.0, ge=0, le=1)  # GAE λ
    # policy loss
    loss: Loss = "decoupled_ppo"  # ppo: naive, ratio to π_behav
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
    # critic (adv_estimator = gae)
    value_coef: Float = Field(0.5, ge=0)
    value_clip: Float = Field(0.2, ge=0)  # 0 disables value clipping
    critic_lr: Float = Field(0.0, ge=0)  # critic's AdamW learning rate; 0: train.lr (train/value_head.py)
    # preference pairs (loss = dpo|ipo)
    dpo_beta: Float = Field(0.1, gt=0)
    dpo_label_smoothing: Float = 0.0
    # data shaping
    dynamic_sampling: Bool = False  # DAPO: drop groups whose rewards are all equal
    overlong_max_len: Int = Field(0, ge=0)  # DAPO L_max in response tokens; 0 disables the overlong penalty
    overlong_buffer: Int = Field(0, ge=0)  # DAPO L_cache
    overlong_penalty: Float = 1.0  # penalty factor
    reward_scale: Float = 1.0
    reward_bias: Float = 0.0
    reward_clip: Float = Field(0.0, ge=0)  # 0 disables

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


PRESETS: dict[str, dict[str, Any]] = {
    # today's trainer: GRPO advantages, decoupled PPO, token-mean, DAPO clip-higher, w capped at 5
    "grpo": {},
    "dr_grpo": {
        "adv_estimator": "dr_grpo",
        "aggregation": "seq_mean_token_sum_norm",
        "eps_high": 0.2,
    },
    # overlong sizes fit the embedded task (rollout.max_new_tokens = 24); scale with the budget
    "dapo": {
        "adv_estimator": "grpo",
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_max_len": 24,
        "overlong_buffer": 6,
        "overlong_penalty": 1.0,
    },
    "rloo": {"adv_estimator": "rloo", "eps_high": 0.2},
    "reinforce_pp": {
        "adv_estimator": "reinforce_pp",
        "eps_high": 0.2,
        "kl_coef": 0.01,
        "kl_estimator": "k1",
        "kl_as_reward": True,
    },
    "reinforce_pp_baseline": {
        "adv_estimator": "reinforce_pp_baseline",
        "eps_high": 0.2,
        "kl_coef": 0.01,
        "kl_estimator": "k2",
    },
    "gspo": {
        "loss": "gspo",
        "aggregation": "seq_mean_token_mean",
        "eps_low": 3e-4,
        "eps_high": 4e-4,
        "behav_level": "geometric",
    },
    "lite_ppo": {"adv_estimator": "lite_ppo", "aggregation": "token_mean", "eps_high": 0.2},
    "ppo_critic": {
        "adv_estimator": "gae",
        "gamma": 1.0,
        "lam": 0.95,
        "adv_whiten": True,
        "eps_high": 0.2,
        "value_coef": 0.5,
        "value_clip": 0.2,
    },
    # baselines and offline alignment
    "naive_ppo": {"loss": "ppo"},
    "icepop": {"behav_correction": "mask", "behav_low": 0.5, "behav_high": 2.0},
    "dpo": {"loss": "dpo", "dpo_beta": 0.1},
    "ipo": {"loss": "ipo", "dpo_beta": 0.1},
}


def from_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """AlgorithmConfig of a named preset, with keyword overrides; validated (ConfigError)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown algorithm preset {name!r}; expected one of {sorted(PRESETS)}")
    return AlgorithmConfig.from_data({**PRESETS[name], **overrides}, prefix="algo")
