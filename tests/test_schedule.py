"""Learning-rate schedules: hand-computed values."""

import math

import pytest

from areal_core.config import ConfigError, load_config
from areal_core.train.schedule import lr_factor


def test_constant_with_warmup():
    assert [lr_factor(s, 10, warmup=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(9, 10) == 1.0


def test_cosine_and_linear_decay_to_the_floor():
    assert lr_factor(0, 100, schedule="cosine") == 1.0
    assert lr_factor(50, 100, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(25, 100, schedule="cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(100, 100, schedule="cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(50, 100, schedule="cosine", min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(75, 100, schedule="linear") == pytest.approx(0.25)
    assert lr_factor(0, 100, warmup=2, schedule="linear") == pytest.approx(0.5)


def test_bad_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="must be one of.*got .exp."):
        load_config("configs/default.yaml", ["train.lr_schedule=exp"])
    with pytest.raises(ConfigError, match=r"lr_min_ratio. must be in \[0, 1\]"):
        load_config("configs/default.yaml", ["train.lr_min_ratio=2.0"])
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(0, 10, schedule="exp")
