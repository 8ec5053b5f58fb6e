"""The Flyte 2 front end (`flyte` SDK 2.x), beside the flytekit one (workflows/, tasks/): the same
jobs as Flyte 2 tasks, each step one call into areal_core (docs/flyte2.md).

    grpo.py      grpo, grpo_cluster (+ the trigger grpo_cluster_weekly)
    online.py    online_retrain (+ online_retrain_nightly), online_continuous
    derived.py   replay, fork, regrade, regrade_and_replay
    steps.py     prepare, prepare_cluster, sft, start_run, evaluate, register
    roles.py     rollout_worker, reward_worker, trainer, and run_roles (the three at once)
    envs.py      the task environments, from the cluster config; images.py: the images, from images/specs.py
    role.py      `python -m flyte2.role`: one role in a process of its own
    dryrun.py    `python -m flyte2.dryrun`: what `flyte deploy` would send, offline
    __main__.py  `python -m flyte2 grpo ...`: checks the config, then runs the job

It runs in its own venv, .venv-flyte2 (scripts/setup_flyte2_venv.sh).
"""
