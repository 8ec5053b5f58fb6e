"""The Flyte 2 front end (`flyte` SDK 2.x), beside the flytekit one (workflows/, tasks/): the jobs of
the job spec (jobs/catalog.py) as Flyte 2 tasks, each step one call of jobs/steps.py (docs/flyte2.md).

    translate.py the job spec in Flyte 2's terms: a job's task signature, output and trigger
    grpo.py      grpo, grpo_cluster (+ the trigger grpo_cluster_weekly)
    online.py    online_retrain (+ online_retrain_nightly), online_continuous
    derived.py   replay, fork, regrade, regrade_and_replay
    steps.py     prepare, prepare_cluster, sft, start_run, evaluate, register
    roles.py     rollout_worker, reward_worker, trainer (each role a process of run/launcher.py), run_roles
    envs.py      the task environments, from the cluster config; images.py: the images, from images/specs.py
    dryrun.py    `python -m flyte2.dryrun`: what `flyte deploy` would send, offline
    __main__.py  `python -m flyte2 grpo ...`: checks the config, then runs the job

It runs in its own venv, .venv-flyte2 (scripts/setup_flyte2_venv.sh).
"""
