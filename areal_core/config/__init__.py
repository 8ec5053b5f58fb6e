"""Typed configuration at the bottom of areal_core: pydantic models for the run (run.py), the
algorithm (algorithm.py) and the cluster (cluster.py); one Device type (device.py); one
"pkg.module:name" loader (hooks.py); YAML in and out (loading.py). Imports nothing else from
areal_core.

    cfg = load_config("configs/default.yaml", ["train.lr=3e-4"])
"""

from areal_core.config.agent import AgentConfig
from areal_core.config.algorithm import AlgorithmConfig
from areal_core.config.base import ConfigError
from areal_core.config.device import DEVICES, Device
from areal_core.config.hooks import import_object
from areal_core.config.loading import (
    changed,
    from_yaml_text,
    load_config,
    parse_override,
    to_dict,
    to_flat_dict,
    to_yaml,
    validate,
)
from areal_core.config.run import (
    EvalConfig,
    LauncherConfig,
    LeaseConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    ServerConfig,
    SFTConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = [
    "DEVICES",
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "Device",
    "EvalConfig",
    "LauncherConfig",
    "LeaseConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "changed",
    "ServerConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "from_yaml_text",
    "import_object",
    "load_config",
    "parse_override",
    "to_dict",
    "to_flat_dict",
    "to_yaml",
    "validate",
]
