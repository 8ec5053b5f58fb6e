"""Every model goes to MLflow one way (`areal_core/run/tracking.py:log_model`): the final model a run's
evaluation logs and every registered version are MLflow transformers models that serve as they are."""

from __future__ import annotations

import pytest

from tests.conftest import TINY


@pytest.fixture
def finished_run(tmp_path):
    """A tracked run root that looks finished: prompts, init/final model (a tiny untrained model),
    a committed checkpoint, DONE and its MLflow run (sqlite)."""
    import torch

    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained
    from areal_core.run import pipeline
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store
    from areal_core.train import checkpoint

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [o for o in TINY if not o.startswith("tracking.")] + ["eval.num_samples=4", "eval.max_new_tokens=4"]
    run_uri, _ = pipeline.prepare("", [*overrides, f"store={tmp_path / 'run'}", f"tracking.uri={tracking}"])
    store = Store(run_uri)
    cfg = load_run_config(store)
    tok = build_tokenizer(["1 + 2 = 3", "user assistant"], cfg.model.vocab_size)
    model = build_tiny_model(cfg.model, len(tok), seed=3)
    for rel in (LAYOUT.init_model, LAYOUT.final_model):
        save_pretrained(model, tok, tmp_path / rel)
        store.put_dir(tmp_path / rel, rel)
        store.write_json(LAYOUT.committed(rel), {})
    checkpoint.save(store, checkpoint.TrainerState(step=4, version=4), model, torch.optim.AdamW(model.parameters()), [])
    store.write_json(LAYOUT.done, {"step": 4, "version": 4, "counters": {}})
    run_id = Tracker.create(store, cfg).run_id
    return store, run_id, tracking


def test_the_final_model_a_run_logs_serves_with_pyfunc_and_is_the_registered_one(finished_run):
    import mlflow

    from areal_core.online.registry import register_run
    from areal_core.run import pipeline

    store, run_id, tracking = finished_run
    pipeline.evaluate_run(store.uri)
    served = mlflow.pyfunc.load_model(f"runs:/{run_id}/final_model")
    assert served.metadata.flavors["transformers"]["task"] == "text-generation"
    text = served.predict(["1 + 2 ="], params={"max_new_tokens": 3})
    assert isinstance(text[0], str) and text[0].startswith("1 + 2 =")

    # registration makes that same artifact a version: no second copy of the model in the run
    out = register_run(store.uri, "policy", "cpu", "x", include_checkpoint=False)
    client = mlflow.MlflowClient(tracking)
    assert client.get_model_version("policy", out["final"].rsplit("/", 1)[-1]).source == f"runs:/{run_id}/final_model"
    assert [f.path for f in client.list_artifacts(run_id) if f.path != "report"] == ["final_model"]
