"""The run configuration: one pydantic model per section, each field with its default, type,
choices and bounds; the checks across fields are the model validators.

    cfg = load_config("configs/default.yaml", ["train.lr=3e-4"])   # areal_core/config/loading.py
    cfg.train.lr, cfg.rollout.server.url
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BeforeValidator, Field, model_validator

from areal_core.config.agent import AgentConfig
from areal_core.config.algorithm import AlgorithmConfig
from areal_core.config.base import (
    PROJECT_ROOT,
    Bool,
    ConfigModel,
    Float,
    Int,
    Interval,
    Invalid,
    StoreUri,
    Str,
    Temperature,
)
from areal_core.config.device import Device
from areal_core.config.operations import LauncherConfig, LeaseConfig, OnlineConfig, TrackingConfig
from areal_core.config.task import TaskConfig

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"  # made by `make vllm-venv`
REMOTE_ENGINES = ("vllm", "sglang")  # rollout.engine values served by a server process; the rest run in the worker


def is_remote_engine(engine: str) -> bool:
    """Whether `rollout.engine` names a server engine (vLLM, SGLang): the worker holds no model, stages
    each version on disk for the server, and the server has its own dtype (rollout.server.dtype)."""
    return engine in REMOTE_ENGINES


def resolve_python(python: str) -> Path:
    """The vLLM server's interpreter: a relative path is taken from the project root."""
    p = Path(python)
    return p if p.is_absolute() else PROJECT_ROOT / p


class ModelConfig(ConfigModel):
    kind: Literal["text", "vlm"] = Field(
        "text",
        description=(
            "text: a causal LM (the tiny Qwen2); vlm: a Qwen2.5-VL vision-language model, tiny or from "
            "model.path (docs/vlm.md)"
        ),
    )
    path: Str = Field(
        "",
        description=(
            "an HF checkpoint folder or URI, or `pretrained:smollm2` (areal_core.pretrained: fetched, converted and "
            "cached); empty: the tiny Qwen2 built from model.*"
        ),
    )
    hidden_size: Int = Field(128, gt=0, description="tiny model: hidden size")
    num_layers: Int = Field(4, gt=0, description="tiny model: transformer layers")
    num_heads: Int = Field(4, gt=0, description="tiny model: attention heads (divides hidden_size)")
    num_kv_heads: Int = Field(2, gt=0, description="tiny model: key/value heads (divides num_heads)")
    intermediate_size: Int = Field(384, gt=0, description="tiny model: MLP width")
    max_position_embeddings: Int = Field(256, gt=0, description="tiny model: longest sequence")
    vocab_size: Int = Field(384, gt=0, description="tokenizer BPE size for the embedded task")
    vision_hidden_size: Int = Field(64, gt=0, description="tiny VLM: vision tower width (kind vlm)")
    vision_layers: Int = Field(2, gt=0, description="tiny VLM: vision tower blocks (kind vlm)")
    patch_size: Int = Field(8, gt=0, description="tiny VLM: vision patch side in pixels (kind vlm)")
    image_size: Int = Field(64, gt=0, description="tiny VLM: images are resized to about image_size² pixels (kind vlm)")

    @model_validator(mode="after")
    def _heads_fit(self) -> Self:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise Invalid("num_heads", "must divide hidden_size and be a multiple of num_kv_heads")
        if self.kind == "vlm" and (self.hidden_size // self.num_heads) % 8:
            raise Invalid("num_heads", "kind vlm: hidden_size / num_heads must be a multiple of 8 (mrope)")
        if self.kind == "vlm" and self.image_size % (2 * self.patch_size):
            raise Invalid("image_size", f"kind vlm: must be a multiple of 2 × patch_size ({2 * self.patch_size})")
        return self


class SFTConfig(ConfigModel):
    enabled: Bool = Field(
        True, description="run the SFT warm start; false: RL starts from model.path (or the untrained tiny model)"
    )
    steps: Int = Field(300, ge=0, description="SFT optimizer steps")
    batch_size: Int = Field(64, gt=0, description="SFT examples per step")
    lr: Float = Field(3e-3, gt=0, description="SFT learning rate")
    warmup_steps: Int = Field(20, ge=0, description="SFT linear warmup steps")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="SFT learning-rate schedule after warmup")
    multi_step_fraction: Float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "share of multi-step problems kept in the SFT set (1.0 keeps all); demonstrations often under-represent "
            "them and RL with the verifier closes the gap"
        ),
    )


class ServerConfig(ConfigModel):
    """The inference server of a remote engine (rollout.engine vllm | sglang); docs/vllm.md."""

    url: Str = Field(
        "",
        description="a running inference server; empty: each vLLM rollout worker starts its own (sglang needs a URL)",
    )
    python: Str = Field(
        DEFAULT_VLLM_PYTHON,
        description="the vLLM server's interpreter (relative: from the project root; `make vllm-venv`)",
    )
    interrupt: Literal["keep", "abort"] = Field(
        "keep", description="on a new weight version: keep (pause, keep requests, re-prefill) or abort (re-submit)"
    )
    kv_cache_mb: Int = Field(256, gt=0, description="vLLM KV cache size in MiB")
    max_num_seqs: Int = Field(256, gt=0, description="vLLM concurrent sequences")
    threads: Int = Field(1, gt=0, description="server CPU threads")
    dtype: Str = Field("float32", description="server weight dtype")
    startup_timeout_s: Float = Field(900.0, gt=0, description="seconds to wait for a started server to answer")
    extra_args: Str = Field("", description="extra server flags, shell-quoted")
    lora: Literal["auto", "native", "merged"] = Field(
        "auto",
        description="a LoRA run's versions on vLLM: adapters by name (native) or merged checkpoints; auto: merged on "
        "CPU (native learned less there, docs/vllm.md), native elsewhere",
    )


class RolloutConfig(ConfigModel):
    engine: Literal["torch", "continuous", "auto", "vllm", "sglang"] = Field(
        "torch",
        description=(
            "torch (static batches, the model's own forward: every architecture), continuous (continuous batching: the "
            "architectures in docs/architectures.md), auto (continuous where it runs the model exactly, else torch), "
            "vllm or sglang (servers; docs/vllm.md)"
        ),
    )
    num_workers: Int = Field(1, gt=0, description="rollout worker processes (cluster: the pool's replicas)")
    group_size: Int = Field(8, ge=2, description="samples per prompt (>= 2 for group-relative advantages)")
    max_batch_groups: Int = Field(8, gt=0, description="groups generated together in one engine batch")
    max_new_tokens: Int = Field(24, gt=0, description="longest response (per turn for agents)")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32",
        description=(
            "built-in engines' weight dtype (bfloat16: faster decoding on CPUs with avx512_bf16 or AMX, emulated and "
            "slow on AVX2-only CPUs; auto: bfloat16 where it is fast; behaviour log-probs then differ slightly from "
            "the trainer's)"
        ),
    )
    temperature: Temperature = Field(1.0, description="sampling temperature (the trainer's log-probs use the same)")
    top_p: Float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")
    top_k: Int = Field(0, ge=-1, description="top-k sampling (0 or -1: off)")
    poll_interval_s: Interval = Field(0.02, description="seconds between checks for new weights and admission")
    swap_mid_generation: Bool = Field(
        True,
        description=(
            "built-in engines: install a new weight version between two decode steps and re-prefill the rows in flight"
            " under it (AReaL's interruptible generation); false: only between engine calls (tokens up to one version "
            "older, no re-prefill)"
        ),
    )
    reprefill_budget_tokens: Int = Field(
        0,
        ge=0,
        description=(
            "built-in engines: a new version waits while more tokens than this are in flight (each swap re-prefills "
            "them all), decoding on under the current one (0: swap at once, as AReaL)"
        ),
    )
    step_delay_s: Float = Field(
        0.0, ge=0, description="benchmarks: sleep per continuous-engine step, to make generation the bottleneck"
    )
    admission: Bool = Field(
        True, description="AReaL's admission rule (staleness bound at generation); off only for tests of the hard bound"
    )
    agent: Str = Field(
        "",
        description="'pkg.module:run' (async run(task, base_url, api_key) -> reward): agent rollouts through the proxy",
    )
    workflow: Str = Field(
        "",
        description=(
            "'pkg.module:Name' (ctx) -> RolloutWorkflow; empty: single-turn, or the agent's when rollout.agent is set"
        ),
    )
    environment: Str = Field(
        "",
        description=(
            "an environment another framework wrote, run as it is (docs/coming_from.md): 'verifiers:<taskset id or "
            "pkg.module:fn>' or 'openenv:<url>'; it gives the prompts and the episodes (rollout.agent is its agent)"
        ),
    )
    server: ServerConfig = Field(default_factory=ServerConfig, description="the inference server of a remote engine")

    @model_validator(mode="after")
    def _server_reachable(self) -> Self:
        if self.engine == "sglang" and not self.server.url:
            raise Invalid("server.url", "is required when rollout.engine is sglang")
        return self


ENVIRONMENT_KINDS = ("verifiers", "openenv")  # areal_core/environments/
ENVIRONMENT_AGENT = "areal_core.environments:run_episode"


class RewardConfig(ConfigModel):
    num_workers: Int = Field(1, gt=0, description="reward worker processes (cluster: the pool's replicas)")
    function: Str = Field(
        "",
        description=(
            "'pkg.module:function', or several comma-separated; our signature, verl's compute_score or TRL's batched "
            "reward_func, detected at prepare (docs/reward.md); empty: the task's verifier"
        ),
    )
    weights: list[Float] = Field(
        default_factory=list,
        description="one weight per reward.function (TRL's reward_weights); empty: 1 each. Reward = Σ weight × value",
    )
    stop_after_failed_groups: Int = Field(
        4,
        ge=0,
        description=(
            "stop the run when every reward of its first this-many groups is a failed call (raised, timed out, "
            "crashed): it would train on zeros; 0: never"
        ),
    )
    pool_size: Int = Field(1, gt=0, description="grading processes per reward worker")
    timeout_s: Float = Field(5.0, gt=0, description="per-sample timeout that kills the call")
    retries: Int = Field(1, ge=0, description="retries of a failed grading call")
    poll_interval_s: Interval = Field(0.02, description="seconds between checks for ungraded shards")

    @model_validator(mode="after")
    def _weights_match(self) -> Self:
        n = len([p for p in self.function.split(",") if p.strip()])
        if self.weights and len(self.weights) != n:
            raise Invalid("weights", f"has {len(self.weights)} weights for {n} reward functions (reward.function)")
        return self


def _on_off(value: object) -> object:
    """YAML reads on/off as booleans (train.compile=on is True): back to the words."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class TrainConfig(ConfigModel):
    steps: Int = Field(200, gt=0, description="RL training steps")
    batch_groups: Int = Field(8, gt=0, description="B: groups per training step")
    eta: Int = Field(2, ge=0, description="staleness bound η (0: synchronous on-policy)")
    lr: Float = Field(1e-3, gt=0, description="RL learning rate")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="decay over train.steps, after warmup"
    )
    lr_warmup_steps: Int = Field(0, ge=0, description="linear warmup steps")
    lr_min_ratio: Float = Field(0.0, ge=0, le=1, description="the decayed rate's floor, as a fraction of train.lr")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: Float = Field(1.0, ge=0, description="gradient-norm clip (0: none)")
    packing: Bool = Field(True, description="pack sequences without padding for the forward passes")
    gradient_checkpointing: Bool = Field(
        False, description="recompute each layer's activations in the backward (long rows: memory for compute)"
    )
    logit_chunk_tokens: Int = Field(
        512,
        ge=0,
        description=(
            "log-probs from the final hidden states, the LM head applied this many tokens at a time (memory "
            "O(chunk × vocab): ~1.5 GB at 512 × 151,936, recomputed in the backward) once a forward's logits "
            "would pass 2^25 values (128 MB); 0: all logits at once"
        ),
    )
    packed_attention: Literal["auto", "segments", "mask"] = Field(
        "auto",
        description=(
            "how packed sequences are kept apart: mask (a 4D [L, L] mask per row), segments (one causal SDPA "
            "per sequence, memory O(L); needs sdpa attention), auto (segments past 1,024-token rows where the "
            "model agrees with its masks)"
        ),
    )
    max_tokens_per_micro_batch: Int = Field(
        0,
        ge=0,
        description=(
            "token budget of one forward/backward: a minibatch runs as micro-batches of whole groups up to this "
            "many tokens, gradients accumulated (0: the whole minibatch at once)"
        ),
    )
    ppo_minibatches: Int = Field(1, gt=0, description="optimizer minibatches per step (divides batch_groups)")
    skip_zero_advantage: Bool = Field(
        True,
        description=(
            "leave rows whose advantages are all 0 (GRPO: groups of equal rewards) out of the forward and backward "
            "where that leaves the gradient unchanged: an advantage-weighted loss, no KL term, entropy bonus or "
            "critic (areal_core/train/zero_advantage.py); false: train every row"
        ),
    )
    checkpoint_every: Int = Field(10, gt=0, description="steps between trainer checkpoints")
    nproc_per_node: Int = Field(
        1, ge=1, description="trainer processes on this machine: above 1, torchrun ranks with FSDP2 (gloo on CPU)"
    )
    keep_checkpoints: Int = Field(
        2, gt=0, description="committed trainer checkpoints kept, the newest ones (a fork starts from one of them)"
    )
    poll_interval_s: Interval = Field(0.01, description="seconds between checks for graded shards")
    slow_step_s: Float = Field(0.0, ge=0, le=3600, description="tests: sleep per step to make training the bottleneck")
    eval_every: Int = Field(0, ge=0, description="steps between held-out evaluations (0: only before and after)")
    weight_delta: Bool = Field(False, description="publish each version as a compressed delta against the previous one")
    weight_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="published versions' dtype (auto: bfloat16 where the engines load bfloat16, else the fp32 master)",
    )
    weight_full_every: Int = Field(
        8, gt=0, description="with weight_delta: a full snapshot when the version is a multiple of this"
    )
    background_publish: Bool = Field(
        True,
        description=(
            "write each version to the store on a helper thread while the next step trains (one in flight; "
            "drained before a checkpoint, a repair and the final model); false: on the trainer's thread"
        ),
    )
    lora_rank: Int = Field(
        0, ge=0, description="LoRA rank r (0: full fine-tuning); >0 trains and publishes only the adapter"
    )
    lora_alpha: Float = Field(16.0, gt=0, description="LoRA scale numerator: updates are (alpha / r)·B·A")
    lora_target_modules: Str = Field(
        "",
        description=(
            "LoRA: the linear layers adapted, comma-separated last names (q_proj,v_proj); empty: every attention "
            "and MLP projection of the architecture, fused ones included (docs/architectures.md); checked at prepare"
        ),
    )
    freeze_vision: Bool = Field(
        False, description="model.kind vlm: RL leaves the vision tower and merger as they are (only the LM trains)"
    )
    bf16_autocast: Bool | Literal["auto"] = Field(
        False,
        description=(
            "the trainer's forward and backward passes under bf16 autocast (weights and optimizer stay fp32); auto: "
            "on accelerators and CPUs with avx512_bf16 or AMX only"
        ),
    )
    borrow_idle_cores: Int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "extra torch threads the trainer's step may take while other processes leave this machine's cores idle "
            "(checked before every decoder layer's forward and backward; the counts used are in each step's audit "
            "record, and a replay follows them; areal_core/train/borrowed_threads.py); 0: threads_per_role always "
            "(the default job measured +11% wall per step with 1: docs/benchmarks.md); not used under FSDP2, off CPU "
            "or with a compiled decoder"
        ),
    )
    compile: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field(
        "auto",
        description=(
            "the trainer's decoder forward and backward compiled by torch.compile (inductor, dynamic shapes; "
            "areal_core/train/compiled_step.py); auto: eager (measured at the default job's shapes on CPU: a cold "
            "compile costs ~63 CPU-s and a step saves ~0.01 of ~0.17 CPU-s, repaid after ~4,000-6,500 steps, past "
            "the job's 800; accelerators not measured; docs/benchmarks.md); on: compiled, except under FSDP2, for "
            "image or replayed-route batches, and past 6 graphs (then eager, logged)"
        ),
    )

    @model_validator(mode="after")
    def _minibatches_divide(self) -> Self:
        if self.batch_groups % self.ppo_minibatches:
            raise Invalid("ppo_minibatches", f"must divide batch_groups ({self.batch_groups})")
        return self


class EvalConfig(ConfigModel):
    num_samples: Int = Field(500, gt=0, description="held-out prompts evaluated")
    batch_size: Int = Field(250, gt=0, description="prompts per evaluation batch")
    max_new_tokens: Int = Field(24, gt=0, description="longest greedy answer")


class RunConfig(ConfigModel):
    name: Str = Field("default", description="the run's name")
    store: StoreUri = Field(
        "runs/default", description="run root: a local path or an fsspec URI (s3://…, endpoint from AWS_ENDPOINT_URL)"
    )
    store_retry_s: Float = Field(
        60.0, ge=0, description="how long every role and the launcher retry transient store errors, with backoff"
    )
    seed: Int = Field(1, ge=-(2**63), lt=2**63, description="seed of the data, the model and sampling")
    threads_per_role: Int = Field(1, gt=0, description="torch threads per role process")
    device: Device = Field("cpu", description="cpu, cuda or npu")
    task: TaskConfig = Field(default_factory=TaskConfig, description="the task and its data")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="the SFT warm start (a cached Flyte task)")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout workers and their engine")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward workers")
    train: TrainConfig = Field(default_factory=TrainConfig, description="the trainer")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking")
    launcher: LauncherConfig = Field(default_factory=LauncherConfig, description="the single-machine launcher")
    algo: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description=(
            "the RL algorithm: advantage estimator, loss, aggregation, regularisers (configs/algorithms/*.yaml, "
            "docs/algorithms.md)"
        ),
    )
    agent: AgentConfig = Field(
        default_factory=AgentConfig, description="agent rollouts, used when rollout.agent is set (docs/proxy.md)"
    )
    lease: LeaseConfig = Field(default_factory=LeaseConfig, description="the run root's ownership lease")
    online: OnlineConfig = Field(default_factory=OnlineConfig, description="continuous online RL's promotion gate")

    @model_validator(mode="after")
    def _environment_runs(self) -> Self:
        """rollout.environment: its agent runs the episodes and its records are the prompts."""
        env = self.rollout.environment
        if not env:
            return self
        kind, sep, rest = env.partition(":")
        if not sep or kind not in ENVIRONMENT_KINDS or not rest.strip():
            raise Invalid(
                "rollout.environment", f"must look like '<kind>:<spec>', kind one of {list(ENVIRONMENT_KINDS)}: {env!r}"
            )
        if self.rollout.agent not in ("", ENVIRONMENT_AGENT):
            raise Invalid("rollout.agent", "must be empty with rollout.environment (the environment runs the episodes)")
        if self.task.loader:
            raise Invalid("task.loader", "must be empty with rollout.environment (the environment gives the prompts)")
        if kind == "openenv" and self.sft.enabled and not (self.agent.sft_examples and self.agent.sft_fraction == 1):
            raise Invalid(
                "sft.enabled",
                "must be false with an openenv: environment (its records are reset seeds, not demonstrations), "
                "unless agent.sft_examples gives every warm-start episode (agent.sft_fraction 1)",
            )
        self.rollout.agent = ENVIRONMENT_AGENT
        return self

    @model_validator(mode="after")
    def _agent_runs(self) -> Self:
        if self.rollout.agent and self.train.eval_every:
            raise Invalid("train.eval_every", "must be 0 with rollout.agent (the evaluate step measures agent success)")
        return self

    @model_validator(mode="after")
    def _vlm_runs(self) -> Self:
        """What a vision-language run cannot do yet (docs/vlm.md), refused before any work starts."""
        if self.model.kind != "vlm":
            if self.train.freeze_vision:
                raise Invalid("train.freeze_vision", "is for model.kind vlm: this model has no vision tower")
            return self
        if self.rollout.engine not in ("torch", "auto"):
            raise Invalid(
                "rollout.engine",
                f"must be torch with model.kind vlm: the {self.rollout.engine} engine takes no images (docs/vlm.md)",
            )
        if self.train.packing:
            raise Invalid("train.packing", "must be false with model.kind vlm: image batches run unpacked")
        if self.train.nproc_per_node > 1:
            raise Invalid("train.nproc_per_node", "must be 1 with model.kind vlm: image batches train on one rank")
        if self.rollout.agent:
            raise Invalid("rollout.agent", "must be empty with model.kind vlm: agent sessions are text-only")
        if self.task.describe_fraction and min(self.rollout.max_new_tokens, self.eval.max_new_tokens) < 32:
            raise Invalid("rollout.max_new_tokens", "and eval's: >= 32 with task.describe_fraction (20-token lists)")
        return self
