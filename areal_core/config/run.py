"""The run configuration: one pydantic model per section, each field with its default, type,
choices and bounds; the checks across fields are the model validators.

    cfg = load_config("configs/default.yaml", ["train.lr=3e-4"])   # areal_core/config/loading.py
    cfg.train.lr, cfg.rollout.server.url
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.config.base import PROJECT_ROOT, Bool, ConfigModel, Float, Int, Invalid, Str
from areal_core.config.device import Device

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"  # made by `make vllm-venv`


def resolve_python(python: str) -> Path:
    """The vLLM server's interpreter: a relative path is taken from the project root."""
    p = Path(python)
    return p if p.is_absolute() else PROJECT_ROOT / p


class TaskConfig(ConfigModel):
    name: Literal["arithmetic", "gsm8k", "code"] = "arithmetic"
    path: Str = ""  # gsm8k: folder or URI holding train.jsonl / test.jsonl
    num_train: Int = Field(20000, gt=0)
    num_eval: Int = Field(500, gt=0)
    min_value: Int = 10
    max_value: Int = 99
    max_steps: Int = 1  # arithmetic: number of worked steps (1..3)
    ops: Str = "+-"

    @model_validator(mode="after")
    def _task_checks(self) -> Self:
        if self.name == "arithmetic":
            if not 1 <= self.max_steps <= 3:
                raise Invalid("max_steps", f"must be in 1..3, got {self.max_steps}")
            if not 0 <= self.min_value < self.max_value:
                raise Invalid("min_value", f"must be >= 0 and < max_value, got {self.min_value}")
            if not self.ops or set(self.ops) - set("+-*"):
                raise Invalid("ops", f"must use only '+-*', got {self.ops!r}")
        if self.name == "gsm8k" and not self.path:
            raise Invalid("path", "is required when task.name is gsm8k")
        return self


class ModelConfig(ConfigModel):
    path: Str = ""  # an HF checkpoint folder/URI; empty: the tiny model built from this config
    hidden_size: Int = Field(128, gt=0)
    num_layers: Int = Field(4, gt=0)
    num_heads: Int = Field(4, gt=0)
    num_kv_heads: Int = Field(2, gt=0)
    intermediate_size: Int = 384
    max_position_embeddings: Int = 256
    vocab_size: Int = 384  # tokenizer BPE size for the embedded task

    @model_validator(mode="after")
    def _heads_fit(self) -> Self:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise Invalid("num_heads", "must divide hidden_size and be a multiple of num_kv_heads")
        return self


class SFTConfig(ConfigModel):
    enabled: Bool = True
    steps: Int = Field(300, ge=0)
    batch_size: Int = Field(64, gt=0)
    lr: Float = 3e-3
    warmup_steps: Int = 20
    schedule: Literal["cosine", "constant"] = "cosine"  # constant: after warmup
    # Share of multi-step problems kept in the SFT set (1.0 keeps all). The default job
    # under-represents them, as demonstrations often do, and RL with the verifier closes the gap.
    multi_step_fraction: Float = Field(1.0, ge=0, le=1)


class ServerConfig(ConfigModel):
    """The inference server of a remote engine (rollout.engine vllm | sglang); docs/vllm.md."""

    url: Str = ""  # a running server; empty: each vLLM rollout worker starts its own (sglang needs a URL)
    python: Str = DEFAULT_VLLM_PYTHON  # the vLLM server's interpreter (relative: from the project root)
    interrupt: Literal["keep", "abort"] = "keep"  # keep: pause, keep requests, re-prefill; abort: re-submit
    kv_cache_mb: Int = Field(256, gt=0)
    max_num_seqs: Int = Field(256, gt=0)
    threads: Int = Field(1, gt=0)
    dtype: Str = "float32"
    startup_timeout_s: Float = 900.0
    extra_args: Str = ""  # extra server flags, shell-quoted


class RolloutConfig(ConfigModel):
    # torch (static batches) | continuous (continuous batching) | vllm | sglang (servers)
    engine: Literal["torch", "continuous", "vllm", "sglang"] = "torch"
    num_workers: Int = Field(1, gt=0)
    group_size: Int = Field(8, ge=2)  # n samples per prompt (>= 2 for group-relative advantages)
    max_batch_groups: Int = Field(8, gt=0)  # groups generated together in one engine batch
    max_new_tokens: Int = Field(24, gt=0)
    temperature: Float = Field(1.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = 0
    poll_interval_s: Float = 0.02
    admission: Bool = True  # AReaL's admission rule; off only for tests of the hard bound
    agent: Str = ""  # "pkg.module:run" (async run(task, base_url, api_key) -> reward): agent rollouts through the proxy
    workflow: Str = (
        ""  # "pkg.module:Name" (ctx) -> RolloutWorkflow; empty: single-turn, or the agent's when agent is set
    )
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _server_reachable(self) -> Self:
        if self.engine == "sglang" and not self.server.url:
            raise Invalid("server.url", "is required when rollout.engine is sglang")
        return self


class AgentConfig(ConfigModel):
    """Agent rollouts, used when rollout.agent is set (docs/proxy.md)."""

    max_concurrent_episodes: Int = Field(32, gt=0)
    episode_timeout_s: Float = Field(300.0, gt=0)
    turn_discount: Float = Field(1.0, ge=0, le=1)  # γ for per-turn rewards
    tool_prompt: Literal["none", "names", "full"] = "none"  # how tools are announced to the model
    corpus: Str = ""  # "pkg.module:fn" (records) -> texts: the tiny tokenizer's training text
    sft_examples: Str = ""  # "pkg.module:fn" (tokenizer, records) -> [(ids, loss_mask)]: warm start episodes
    sft_fraction: Float = Field(1.0, ge=0, le=1)  # share of SFT records given as agent episodes; the rest as answers
    # every reward from outside (a proxy client, an agent's return value) must be finite and within
    # [reward_min, reward_max]; online retraining drops rows outside it (docs/proxy.md)
    reward_min: Float = -10.0
    reward_max: Float = 10.0

    @model_validator(mode="after")
    def _reward_range(self) -> Self:
        if not -1e30 <= self.reward_min < self.reward_max <= 1e30:
            raise Invalid("reward_max", f"must be above reward_min ({self.reward_min:g}), both within ±1e30")
        return self


class RewardConfig(ConfigModel):
    num_workers: Int = Field(1, gt=0)
    function: Str = ""  # "pkg.module:function"; empty: the task's verifier
    pool_size: Int = Field(1, gt=0)
    timeout_s: Float = Field(5.0, gt=0)
    retries: Int = Field(1, ge=0)
    poll_interval_s: Float = 0.02


class TrainConfig(ConfigModel):
    steps: Int = Field(200, gt=0)
    batch_groups: Int = Field(8, gt=0)  # B: groups per training step
    eta: Int = Field(2, ge=0)  # staleness bound η
    lr: Float = Field(1e-3, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # decay over train.steps, after warmup
    lr_warmup_steps: Int = Field(0, ge=0)
    lr_min_ratio: Float = Field(0.0, ge=0, le=1)  # the decayed rate's floor, as a fraction of train.lr
    weight_decay: Float = 0.0
    grad_clip: Float = 1.0
    packing: Bool = True  # pack sequences without padding for the forward passes
    ppo_minibatches: Int = Field(1, gt=0)
    checkpoint_every: Int = Field(10, gt=0)
    poll_interval_s: Float = 0.01
    slow_step_s: Float = 0.0  # tests: sleep per step to make training the bottleneck
    eval_every: Int = 0  # 0: only before/after
    weight_delta: Bool = False  # publish each version as a compressed delta against the previous one
    weight_full_every: Int = Field(8, gt=0)  # with weight_delta: a full snapshot when the version is a multiple

    @model_validator(mode="after")
    def _minibatches_divide(self) -> Self:
        if self.batch_groups % self.ppo_minibatches:
            raise Invalid("ppo_minibatches", f"must divide batch_groups ({self.batch_groups})")
        return self


class EvalConfig(ConfigModel):
    num_samples: Int = Field(500, gt=0)
    batch_size: Int = Field(250, gt=0)
    max_new_tokens: Int = 24


class TrackingConfig(ConfigModel):
    enabled: Bool = True
    uri: Str = ""  # empty: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns.db
    experiment: Str = "areal-flyte"


class LauncherConfig(ConfigModel):
    timeout_s: Float = 1800.0
    progress: Bool = True


class LeaseConfig(ConfigModel):
    """The run root's ownership lease (areal_core/run/ownership.py)."""

    timeout_s: Float = Field(300.0, gt=0)  # a lease not renewed for this long is stale
    interval_s: Float = Field(5.0, gt=0)  # how often the roles check it (and the trainer renews it)
    takeover: Bool = False  # take over a stale lease of another run (never a live one); not kept in config.yaml

    @model_validator(mode="after")
    def _renewed_in_time(self) -> Self:
        if self.interval_s * 2 > self.timeout_s:
            raise Invalid("interval_s", f"must be at most half of timeout_s ({self.timeout_s:g})")
        return self


class RunConfig(ConfigModel):
    name: Str = "default"
    store: Str = "runs/default"  # fsspec URI or local path of the run root
    store_retry_s: Float = Field(60.0, ge=0)  # how long a role retries transient store errors (areal_core/retry.py)
    seed: Int = 1
    threads_per_role: Int = Field(1, gt=0)
    device: Device = "cpu"
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    algo: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    lease: LeaseConfig = Field(default_factory=LeaseConfig)

    @model_validator(mode="after")
    def _agent_runs(self) -> Self:
        if self.rollout.agent and self.train.eval_every:
            raise Invalid("train.eval_every", "must be 0 with rollout.agent (the evaluate step measures agent success)")
        return self
