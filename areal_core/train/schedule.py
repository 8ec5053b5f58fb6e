"""Learning-rate schedules as pure functions of the step (no scheduler state to checkpoint)."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, total: int, warmup: int = 0, schedule: str = "constant", min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based) of `total`.

    warm(s)     = min(1, (s + 1) / warmup)                       (1 when warmup = 0)
    constant:   f(s) = warm(s)
    cosine:     f(s) = warm(s) · (r + (1 − r) · ½(1 + cos(π s / total)))
    linear:     f(s) = warm(s) · (r + (1 − r) · (1 − s / total))
    with r = min_ratio, the floor the rate decays to.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {SCHEDULES}")
    warm = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if schedule == "constant":
        return warm
    progress = min(max(step / max(total, 1), 0.0), 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return warm * (min_ratio + (1.0 - min_ratio) * decay)


def set_lr(optimizer, train_cfg, step: int) -> float:
    """Set step `step`'s learning rate (base `train.lr` times `lr_factor`) on every parameter group."""
    tc = train_cfg
    lr = tc.lr * lr_factor(step, tc.steps, tc.lr_warmup_steps, tc.lr_schedule, tc.lr_min_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
