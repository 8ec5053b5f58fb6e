"""The layout checks megatron-core enforces at start-up, made at `prepare` time (one line naming
the setting instead of a failure minutes into a GPU job), and the import of megatron-core itself.

The checks: TP divides heads, KV groups, hidden and FFN sizes; PP (x the virtual pipeline)
divides layers; TP·PP·CP divides the world size; the minibatch splits into micro-batches over the
data-parallel ranks; sequence parallel needs TP >= 2; CP needs the sequence length divisible by
2·CP.
"""

from __future__ import annotations

import json
from typing import Any

from areal_core.config import ConfigError
from areal_core.layout import LAYOUT
from areal_core.megatron.shapes import MegatronParallel, ModelShape, shape_from_hf_config


def model_shape(run_cfg: Any) -> ModelShape:
    """The shape of the run's model: the HF checkpoint's config.json when model.path is set,
    else the tiny Qwen2 the config describes (`models.build_tiny_model`: tied, q/k/v biases)."""
    m = run_cfg.model
    if m.path:
        from areal_core.store import Store

        hf = json.loads(Store(m.path).read_text(LAYOUT.hf_config))
        shape = shape_from_hf_config(hf)
        if "max_position_embeddings" not in hf:
            shape.max_position_embeddings = m.max_position_embeddings
        return shape
    return ModelShape(
        m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size,
        m.max_position_embeddings, tie_word_embeddings=True,
    )  # fmt: skip


def check_megatron_config(run_cfg: Any, par: MegatronParallel, shape: ModelShape | None = None) -> ModelShape:
    """Raise ConfigError (one line naming the setting) on a TP/PP/CP layout megatron-core rejects."""
    s = shape or model_shape(run_cfg)
    tp, pp, cp = par.tensor, par.pipeline, par.context
    for name, value in (("tensor", tp), ("pipeline", pp), ("context", cp), ("micro_batch_size", par.micro_batch_size)):
        if value < 1:
            raise ConfigError(f"megatron: {name} parallel size must be >= 1, got {value}")
    if getattr(run_cfg, "device", "cuda") != "cuda":
        raise ConfigError(f"megatron backend needs device cuda, got {run_cfg.device!r}")
    if par.world_size % par.model_parallel:
        raise ConfigError(
            f"megatron: world size {par.world_size} is not a multiple of tensor x pipeline x context = "
            f"{par.model_parallel}"
        )
    for key, value in (
        ("num_heads", s.num_heads),
        ("num_kv_heads", s.num_kv_heads),
        ("hidden_size", s.hidden_size),
        ("intermediate_size", s.intermediate_size),
    ):
        if value % tp:
            raise ConfigError(f"megatron: tensor parallel {tp} must divide model.{key}={value}")
    if s.num_layers % (pp * par.virtual_pipeline):
        raise ConfigError(
            f"megatron: pipeline parallel {pp} x virtual {par.virtual_pipeline} must divide "
            f"model.num_layers={s.num_layers}"
        )
    if par.virtual_pipeline > 1 and pp < 2:
        raise ConfigError("megatron: an interleaved (virtual) pipeline needs pipeline parallel >= 2")
    if par.sequence_parallel and tp < 2:
        raise ConfigError("megatron: sequence parallel needs tensor parallel >= 2")
    if cp > 1 and s.max_position_embeddings % (2 * cp):
        raise ConfigError(f"megatron: context parallel {cp} needs model.max_position_embeddings divisible by {2 * cp}")
    global_batch = run_cfg.train.batch_groups * run_cfg.rollout.group_size // run_cfg.train.ppo_minibatches
    per_step = par.micro_batch_size * par.data_parallel
    if global_batch % per_step:
        raise ConfigError(
            f"megatron: a minibatch of {global_batch} sequences (train.batch_groups x rollout.group_size / "
            f"train.ppo_minibatches) must split into micro-batches of {par.micro_batch_size} over "
            f"{par.data_parallel} data-parallel ranks"
        )
    return s


def import_megatron() -> Any:
    """megatron.core, or an ImportError that says where it is installed."""
    try:
        import megatron.core as mcore  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(
            "the megatron backend needs megatron-core (the cuda image, images/specs.py; `pip install '.[megatron]'`; "
            "or the CPU test venv of scripts/setup_megatron_venv.sh); it is not installed in this environment"
        ) from exc
    return mcore
