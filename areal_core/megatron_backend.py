"""The former home of the megatron-core backend, kept so that its importers
(`run/cluster.py`, tests/test_cluster.py) go on working: everything lives in `areal_core/megatron/`
now (docs/megatron.md)."""

from areal_core.megatron.checks import check_megatron_config, import_megatron, model_shape
from areal_core.megatron.shapes import MegatronParallel, ModelShape, transformer_config_kwargs

__all__ = [
    "MegatronParallel",
    "ModelShape",
    "check_megatron_config",
    "import_megatron",
    "model_shape",
    "transformer_config_kwargs",
]
