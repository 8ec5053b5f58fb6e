"""Every job, declared once: its inputs (types, defaults, docs), its output, its steps, its cache
versions and its schedule. `workflows/` + `tasks/` (flytekit) and `flyte2/` (Flyte 2) build their
entities from these declarations (jobs/spec.py: function); a new input is one edit here.

    job                  steps (jobs/steps.py)
    grpo                 prepare -> sft -> train -> evaluate
    grpo_cluster         prepare_cluster -> sft -> start_run -> train (pools | trainer) -> evaluate -> register
    online_retrain       retrain -> publish                                    (schedule: online_retrain_nightly)
    online_continuous    prepare -> sft -> continuous
    replay               replay -> evaluate
    fork                 fork -> train -> evaluate
    regrade              regrade
    regrade_and_replay   regrade -> replay -> evaluate
"""

from __future__ import annotations

import datetime

from areal_core.config import RunConfig
from areal_core.run.cluster import UNSCHEDULED, registered_cluster
from jobs.spec import Cache, Input, Job, Plan, Record, Schedule

DEFAULT_CONFIG = "configs/default.yaml"
ONLINE_CONFIG = "configs/agent_calculator.yaml"
NIGHTLY_CRON = "0 3 * * *"  # every night at 03:00 UTC

# The SFT result depends only on sft_key (seed, task, model and SFT settings), not on the run root,
# so another run (a scheduled one, a new store) hits it. Bump the version when SFT changes what it
# produces for the same key. A hit is copied into the run root, and a hit whose folder is gone is
# trained again there (areal_core/run/pipeline.py: ensure_init_model).
SFT_CACHE = Cache(step="sft", version="2", ignored=("run_uri",))

# -- the outputs ----------------------------------------------------------------------------------
ACCURACY = Record("Accuracy", (("before", float), ("after", float)))
REPLAYED = Record(
    "Replayed",
    (
        ("steps", int),
        ("max_loss_rel_diff", float),
        ("max_grad_norm_rel_diff", float),
        ("before", float),
        ("after", float),
    ),
)
REGRADED = Record("Regraded", (("layer", str), ("samples", int), ("changed", int), ("samples_per_s", float)))
ONLINE_RESULT = Record(
    "OnlineResult",
    (
        ("rows", int),
        ("registered", bool),
        ("model_uri", str),
        ("current_score", float),
        ("candidate_score", float),
    ),
)

# -- the inputs several jobs share ----------------------------------------------------------------
CFG = Input(
    "cfg",
    RunConfig,
    "the run config as JSON; its fields that differ from the defaults apply over the YAML files (README)",
    RunConfig(),
)
CONFIG_DOC = "YAML config files, comma-separated, applied in order over the defaults"
CONFIG = Input("config", str, CONFIG_DOC, DEFAULT_CONFIG)
OVERRIDES = Input(
    "overrides", str, "dotted key=value overrides, whitespace-separated with shell quoting, applied last", ""
)
RESUME_RUN = Input(
    "resume_run",
    bool,
    "a flag: continue the run in the run root (same run id and config) instead of starting afresh",
    False,
)
KICKOFF_TIME = Input(
    "kickoff_time",
    datetime.datetime,
    "set by the schedule: the run's own root is <store>/<kickoff time>; 1970-01-01 (default): a manual run",
    UNSCHEDULED,
)
RUN = Input("run", str, "the run root (a local path or s3://...)")
INTO = Input("into", str, "a new, empty run root for the derived run")
LAYER = Input("layer", str, "the new layer's name (letters, digits, '.', '_', '-')")
REWARD = Input("reward", str, "the reward function, 'pkg.module:function'; empty: the run's own", "")
POOL_SIZE = Input("pool_size", int, "grading processes", 2)
DERIVED_OVERRIDES = Input(
    "overrides",
    str,
    "dotted key=value settings over the run's config (algo.*, train.*, seed ...), split as a shell does",
    "",
)


# -- the schedules --------------------------------------------------------------------------------
def weekly_plan() -> Plan:
    """The cluster config's `schedule`: cron, the run's config and overrides, the registered model."""
    sched = registered_cluster().schedule
    inputs = {"config": sched.config, "overrides": sched.overrides, "resume_run": False, "model_name": sched.model_name}
    return Plan(cron=sched.cron, inputs=inputs, notify=tuple(sched.notify))


def nightly_plan() -> Plan:
    """Every night with the online config; the cluster config's `schedule.notify` is e-mailed."""
    inputs = {"config": ONLINE_CONFIG, "model_name": ONLINE_RETRAIN.input("model_name").default}
    return Plan(cron=NIGHTLY_CRON, inputs=inputs, notify=tuple(registered_cluster().schedule.notify))


WEEKLY = Schedule(
    "grpo_cluster_weekly", "weekly retraining, each run in its own run root <store>/<kickoff time>", weekly_plan
)
NIGHTLY = Schedule(
    "online_retrain_nightly", "nightly retraining on the sessions the proxy collected since the last run", nightly_plan
)

# -- the jobs -------------------------------------------------------------------------------------
GRPO = Job(
    "grpo",
    "Asynchronous GRPO on one machine: prepare, SFT (cached), every role at once, evaluate; held-out accuracy.",
    (CFG, CONFIG, OVERRIDES, RESUME_RUN),
    ACCURACY,
    ("prepare", "sft", "train", "evaluate"),
)
GRPO_CLUSTER = Job(
    "grpo_cluster",
    "Asynchronous GRPO on a cluster, each role its own pods; returns the registered final model's models:/ URI "
    "('': no tracking).",
    (
        CFG,
        CONFIG,
        OVERRIDES,
        RESUME_RUN,
        Input(
            "model_name", str, "the MLflow registered model the final model is registered under", "areal-flyte-policy"
        ),
        KICKOFF_TIME,
    ),
    str,
    ("prepare_cluster", "sft", "start_run", "train", "evaluate", "register"),
    WEEKLY,
)
ONLINE_RETRAIN = Job(
    "online_retrain",
    "Retrain on the sessions the proxy collected since the last run; register the candidate only when it is better.",
    (
        Input("sessions", str, "the proxy's session store; empty: <store>/sessions", ""),
        Input("config", str, CONFIG_DOC, ONLINE_CONFIG),
        OVERRIDES,
        Input(
            "model_name", str, "the MLflow registered model to compare with and register under", "areal-online-policy"
        ),
        Input("min_gain", float, "how much better (held-out score) the candidate must be to be registered", 0.0),
        Input(
            "kickoff_time",
            datetime.datetime,
            "set by the schedule: names the run; 1970-01-01 (default): a manual run, named by the time",
            UNSCHEDULED,
        ),
    ),
    ONLINE_RESULT,
    ("retrain", "publish"),
    NIGHTLY,
)
ONLINE_CONTINUOUS = Job(
    "online_continuous",
    "Continuous online RL: the trainer and the reward pool on a run root that a serving proxy "
    "(`--follow RUN/weights --store RUN`) feeds with sessions; returns the final model's URI.",
    (CFG, Input("config", str, CONFIG_DOC, ONLINE_CONFIG), OVERRIDES, RESUME_RUN),
    str,
    ("prepare", "sft", "continuous"),
)
REPLAY = Job(
    "replay",
    "Train on a run's stored samples in their recorded order into a new run root, then evaluate.",
    (
        RUN,
        INTO,
        DERIVED_OVERRIDES,
        Input("layer", str, "the samples' rewards: 'graded' (the run's) or a committed re-graded layer", "graded"),
    ),
    REPLAYED,
    ("replay", "evaluate"),
)
FORK = Job(
    "fork",
    "Continue a run from its checkpoint at `step` in a new run root under new settings, to DONE; then evaluate.",
    (
        RUN,
        Input("step", int, "a step with a committed checkpoint (trainer/checkpoints/step-N)"),
        INTO,
        Input(
            "overrides",
            str,
            "dotted key=value settings over the parent's config (train.*, algo.*, ...; not model, sft, seed)",
            "",
        ),
    ),
    ACCURACY,
    ("fork", "train", "evaluate"),
)
REGRADE = Job(
    "regrade",
    "Re-grade a run's graded samples into a new layer beside the old one.",
    (RUN, LAYER, REWARD, POOL_SIZE),
    REGRADED,
    ("regrade",),
)
REGRADE_AND_REPLAY = Job(
    "regrade_and_replay",
    "Re-grade a run into a new layer, retrain on its samples with the new rewards in their recorded order; evaluate.",
    (RUN, LAYER, INTO, REWARD, POOL_SIZE, DERIVED_OVERRIDES),
    REPLAYED,
    ("regrade", "replay", "evaluate"),
)

JOBS: dict[str, Job] = {
    job.name: job
    for job in (GRPO, GRPO_CLUSTER, ONLINE_RETRAIN, ONLINE_CONTINUOUS, REPLAY, FORK, REGRADE, REGRADE_AND_REPLAY)
}
