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

from typing import Any

from jobs.catalog import FORK
from jobs.spec import Given
from tasks.fork import fork_run
from tasks.pipeline import evaluate, run_async_rl
from workflows.translate import workflow_of


def _fork(given: Given) -> Any:
    child = fork_run(run=given.run, step=given.step, into=given.into, overrides=given.overrides)
    models = run_async_rl(run_uri=child.run_uri, sft_checkpoint=child.sft_checkpoint)
    return evaluate(run_uri=child.run_uri, init_model=models.init_model, final_model=models.final_model)


fork = workflow_of(FORK, _fork)
