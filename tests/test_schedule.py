"""Schedules: learning-rate schedules (hand-computed values), and the launch plans' Flyte
schedules checked with FlyteAdmin's launch-plan validation rules."""

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


# -- launch plans: FlyteAdmin's rules ---------------------------------------------------------
# flyteadmin pkg/manager/impl/validation/launch_plan_validator.go (ValidateLaunchPlan,
# checkAndFetchExpectedInputForLaunchPlan, validateSchedule), the identifier checks, the native
# cron parser (robfig/cron v3 ParseStandard: 5 fields or a descriptor) and the notification message's own checks.


def cron_ok(expr: str) -> bool:
    """A cron expression FlyteAdmin accepts (robfig/cron v3 ParseStandard; areal_core/config/cron.py)."""
    from areal_core.config.cron import cron_error

    return cron_error(expr) == ""


def admin_errors(lp_idl, wf_interface_idl) -> list[str]:
    """Every rule of ValidateLaunchPlan the launch plan (admin LaunchPlan proto) breaks, given
    its workflow's interface (core TypedInterface proto)."""
    from flyteidl.core import types_pb2

    errors: list[str] = []
    spec = lp_idl.spec
    for what, ident in (("id", lp_idl.id), ("spec.workflow_id", spec.workflow_id)):
        for part in ("project", "domain", "name", "version"):
            if not getattr(ident, part):
                errors.append(f"{what}.{part} is missing")
    wf_inputs = dict(wf_interface_idl.inputs.variables)
    defaults = dict(spec.default_inputs.parameters)
    fixed = dict(spec.fixed_inputs.literals)
    if not wf_inputs and (defaults or fixed):
        errors.append("launch plan inputs for a workflow without inputs")
    for name in defaults:
        if not defaults[name].HasField("default") and not defaults[name].required:
            errors.append(f"default_input {name} has neither default, nor is required")
        if name not in wf_inputs:
            errors.append(f"unexpected default_input {name}")
        elif defaults[name].var.type != wf_inputs[name].type:
            errors.append(f"invalid default_input wrong type {name}")
    for name in fixed:
        if name not in wf_inputs:
            errors.append(f"unexpected fixed_input {name}")
    expected = {}
    for name, var in wf_inputs.items():
        if name in defaults:
            expected[name] = (defaults[name].required, defaults[name].var.type)
        elif name not in fixed:
            expected[name] = (True, var.type)
    sched = spec.entity_metadata.schedule
    cron = sched.cron_schedule.schedule or sched.cron_expression
    if cron or sched.HasField("rate"):
        kickoff = sched.kickoff_time_input_arg
        for name, (required, _) in expected.items():
            if required and name != kickoff:
                errors.append(f"schedule with an unbound required input {name}")
        if kickoff:
            if kickoff not in expected:
                errors.append(f"KickoffTimeInputArg {kickoff} is not free or does not exist")
            elif expected[kickoff][1].simple != types_pb2.SimpleType.DATETIME:
                errors.append(f"KickoffTimeInputArg {kickoff} must reference a datetime input")
        if cron and not cron_ok(cron):
            errors.append(f"invalid cron expression {cron!r}")
        if sched.HasField("rate") and sched.rate.value <= 0:
            errors.append("a fixed rate must be positive")
    from flyteidl.core import execution_pb2

    terminal = {getattr(execution_pb2.WorkflowExecution, p) for p in ("SUCCEEDED", "FAILED", "ABORTED", "TIMED_OUT")}
    for note in spec.entity_metadata.notifications:
        if not note.phases:
            errors.append("a notification without phases")
        if set(note.phases) - terminal:
            errors.append("a notification on a phase that is not terminal")
        kind = note.WhichOneof("type")
        if kind == "email" and not all("@" in r for r in note.email.recipients_email or [""]):
            errors.append("an e-mail notification needs recipients")
    return errors


def _launch_plans():
    from flytekit import LaunchPlan
    from flytekit.core.workflow import WorkflowBase

    import workflows.grpo
    import workflows.online

    plans = {}
    for module in (workflows.grpo, workflows.online):
        for value in vars(module).values():
            if isinstance(value, LaunchPlan):
                plans[value.name] = value
            elif isinstance(value, WorkflowBase):  # registering a workflow creates its default launch plan
                plans[value.name] = LaunchPlan.get_or_create(value)
    return plans


def test_rule_checker_catches_what_flyteadmin_rejects():
    assert cron_ok("0 3 * * 1") and cron_ok("*/15 0-6 1,15 JAN-JUN MON") and cron_ok("@weekly")
    assert not cron_ok("0 3 * *") and not cron_ok("61 * * * *") and not cron_ok("0 3 * * 1 2026")
    # robfig/cron v3's own cases: names in any case, "?", N/step, time zones, @every durations
    assert cron_ok("5/15 * ? * sun-Sat") and cron_ok("CRON_TZ=Europe/Paris 0 3 * * 1") and cron_ok("@every 1h30m")
    # accepted by croniter (flytekit's check) but not by FlyteAdmin: Sunday as 7, backwards
    # ranges, a zero step, seconds, unknown zones and descriptors
    for bad in ("0 3 * * 7", "0 5-1 * * *", "*/0 * * * *", "0 0 3 * * 1", "TZ=Nowhere/X 0 3 * * *", "@reboot"):
        assert not cron_ok(bad), bad
    import datetime

    from flytekit import CronSchedule, LaunchPlan, workflow

    from tests.test_flyte import serialize

    @workflow
    def wf(kickoff_time: datetime.datetime | None = None, a: int = 1) -> int:
        return a

    lp = LaunchPlan.get_or_create(
        wf, "bad", schedule=CronSchedule(schedule="0 3 * * 1", kickoff_time_input_arg="kickoff_time")
    )
    errors = admin_errors(serialize(lp).to_flyte_idl(), serialize(wf).template.interface.to_flyte_idl())
    assert errors == ["KickoffTimeInputArg kickoff_time must reference a datetime input"]


def test_every_launch_plan_passes_flyteadmin_validation():
    from tests.test_flyte import serialize

    plans = _launch_plans()
    assert {"grpo_cluster_weekly", "online_retrain_nightly", "workflows.grpo.grpo"} <= set(plans)
    scheduled = 0
    for name, lp in plans.items():
        lp_idl = serialize(lp).to_flyte_idl()
        wf_idl = serialize(lp.workflow).template.interface.to_flyte_idl()
        assert admin_errors(lp_idl, wf_idl) == [], name
        if lp_idl.spec.entity_metadata.schedule.kickoff_time_input_arg:
            scheduled += 1
            notes = lp_idl.spec.entity_metadata.notifications
            assert notes and notes[0].email.recipients_email, f"{name}: no failure notification"
    assert scheduled == 2


def test_a_schedule_flyteadmin_would_reject_is_a_cluster_config_error():
    """flytekit's CronSchedule accepts "0 3 * * 7" (croniter); FlyteAdmin rejects it at registration."""
    from areal_core.config.cluster import cluster_config_from_dict

    assert cluster_config_from_dict({"schedule": {"cron": "@weekly"}}).schedule.cron == "@weekly"
    with pytest.raises(ConfigError, match=r"'schedule.cron' is not a cron expression FlyteAdmin accepts .*above max"):
        cluster_config_from_dict({"schedule": {"cron": "0 3 * * 7"}})
