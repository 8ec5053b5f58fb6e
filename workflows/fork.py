"""Fork a run at a checkpoint and continue it under new settings (areal_core/run/fork.py):
fork -> run_async_rl (every role on one machine, to DONE) -> evaluate.

    pyflyte run workflows/fork.py fork --run runs/default --step 100 --into runs/fork-lr --overrides "train.lr=1e-4"

The child root holds the parent's checkpoint at `step` (weights v_step) and reads the parent's
remaining graded shards by reference; the parent root gains only lineage/children/{id}.json.
A run on S3 forks into an S3 root the same way. A step without a committed checkpoint is refused
with the available steps (a run keeps its newest train.keep_checkpoints, every
train.checkpoint_every steps).
"""

from __future__ import annotations

from flytekit import workflow

from tasks.fork import fork_run
from tasks.pipeline import Accuracy, evaluate, run_async_rl


@workflow
def fork(run: str, step: int, into: str, overrides: str = "") -> Accuracy:
    """Continue a run from its checkpoint at `step` in a new run root under new settings, to DONE; then evaluate.

    :param run: the run root to fork (a local path or s3://...)
    :param step: a step with a committed checkpoint (trainer/checkpoints/step-N)
    :param into: a new, empty run root for the child
    :param overrides: dotted key=value settings over the parent's config (train.*, algo.*, ...; not model, sft, seed)
    """
    child = fork_run(run=run, step=step, into=into, overrides=overrides)
    models = run_async_rl(run_uri=child.run_uri, sft_checkpoint=child.sft_checkpoint)
    return evaluate(run_uri=child.run_uri, init_model=models.init_model, final_model=models.final_model)
