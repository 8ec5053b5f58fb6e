"""Runs started at once on a new MLflow sqlite file: without the lock beside the file, their schema
migrations race and most of them fail ("Online migration expected to match one row"; 10 of 12
processes in three trials); with it, each one opens the store in turn and every run is tracked."""

from __future__ import annotations

import subprocess
import sys

from areal_core.run.tracking import mlflow_client
from tests.conftest import ROOT

OPEN_AND_CREATE = (
    "import sys; from areal_core.run.tracking import mlflow_client; "
    "mlflow_client(sys.argv[1]).create_experiment(sys.argv[2])"
)


def test_runs_started_at_once_on_a_new_sqlite_file_are_all_tracked(tmp_path):
    uri = f"sqlite:///{tmp_path / 'nested' / 'mlruns.db'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", OPEN_AND_CREATE, uri, f"exp-{i}"], cwd=ROOT, stderr=subprocess.PIPE)
        for i in range(4)
    ]
    failures = [p.stderr.read().decode()[-500:] for p in procs if p.wait(timeout=300) != 0]
    assert not failures, failures
    names = {e.name for e in mlflow_client(uri).search_experiments()}
    assert {f"exp-{i}" for i in range(4)} <= names
