"""Re-grade a run with a fixed or new reward, without generating again (areal_core/reward/regrade.py),
and optionally retrain on the re-graded samples (areal_core/run/replay.py).

    pyflyte run workflows/regrade.py regrade --run s3://bucket/runs/job --layer strict-v2 --reward mypkg.rewards:strict
    pyflyte run workflows/regrade.py regrade_and_replay --run runs/default --layer strict-v2 \\
        --reward mypkg.rewards:strict --into runs/default-strict

The new layer is written beside the old one (trajectories/regraded/{layer}/ in the run root),
never in place; its summary says how many rewards changed (which: changes.parquet).
"""

from __future__ import annotations

from typing import Any

from jobs.catalog import REGRADE, REGRADE_AND_REPLAY
from jobs.spec import Given
from tasks.regrade import regrade_run
from tasks.replay import replay_run
from workflows.replay import evaluated_replay
from workflows.translate import workflow_of


def _regrade(given: Given) -> Any:
    return regrade_run(run=given.run, layer=given.layer, reward=given.reward, pool_size=given.pool_size)


def _regrade_and_replay(given: Given) -> Any:
    graded = regrade_run(run=given.run, layer=given.layer, reward=given.reward, pool_size=given.pool_size)
    return evaluated_replay(replay_run(run=given.run, into=given.into, overrides=given.overrides, layer=graded.layer))


regrade = workflow_of(REGRADE, _regrade)
regrade_and_replay = workflow_of(REGRADE_AND_REPLAY, _regrade_and_replay)
