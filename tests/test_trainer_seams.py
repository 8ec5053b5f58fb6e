"""The trainer's seams (train/trainer.py): it is built from parts, a BatchSource and a Sink; its
constructor writes nothing; counters are typed and survive a checkpoint; under LoRA a checkpoint
holds the adapter and the optimizer state of the adapter alone; nothing outside train/ reaches
into the trainer's private methods or subclasses it."""

from __future__ import annotations

import ast
import io
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.protocol import encode_shard
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.counters import TrainerCounters
from areal_core.train.parts import load_parts
from areal_core.train.run_trainer import build_run_trainer
from areal_core.train.sinks import CheckpointSink, NullSink
from areal_core.train.sources import Batch, BatchSource
from areal_core.train.trainer import Trainer
from tests.conftest import TINY
from tests.test_lineage import groups

ROOT = Path(__file__).resolve().parents[1]


def prepared(tmp_path, *extra: str) -> tuple[str, Store]:
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", "sft.enabled=false", *extra])
    pipeline.sft(run_uri)
    return run_uri, Store(run_uri)


def write_groups(store: Store, seq: int, count: int, version: int = 0) -> None:
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    rng = random.Random(seq)
    store.write_bytes(LAYOUT.graded_shard("w", seq), encode_shard(groups(rng, f"s{seq}", count, version, vocab)))


class Listed(BatchSource):
    """A source of the given batches, then exhausted."""

    def __init__(self, batches: list[Batch]):
        self.batches = batches

    def next_batch(self, state):
        return self.batches.pop(0) if self.batches else None


def test_the_constructor_writes_nothing_and_start_publishes(tmp_path):
    run_uri, store = prepared(tmp_path)
    before = sorted(store.find(""))
    trainer = build_run_trainer(run_uri, load_run_config(store))
    assert sorted(store.find("")) == before  # nothing published, nothing written
    assert store.latest_version() is None
    trainer.start()
    trainer.start()  # idempotent
    assert store.latest_version() == 0 and store.exists("weights/v000000/MANIFEST.json")


def test_counters_are_typed_and_survive_a_checkpoint(tmp_path):
    run_uri, store = prepared(tmp_path, "train.eta=0")
    write_groups(store, 0, 2, version=0)
    cfg = load_run_config(store)
    trainer = build_run_trainer(run_uri, cfg)
    trainer.start()
    batch = trainer.source.next_batch(trainer.state)
    trainer.step(batch.samples, batch.dropped, batch.abandoned)  # now at v1
    write_groups(store, 1, 1, version=0)  # older than v1 - eta: dropped
    store.write_bytes(LAYOUT.graded_shard("w", 2), b"not arrow")  # quarantined
    batch = trainer.source.next_batch(trainer.state)
    assert batch.samples is None and len(batch.dropped) == 4
    trainer.save_checkpoint()
    c = trainer.state.counters
    assert (c.trained_samples, c.quarantined_shards) == (8, 1)
    assert c.discarded_groups == 1  # the dropped group is given back to admission
    again = build_run_trainer(run_uri, cfg)
    assert again.state.counters == c and isinstance(again.state.counters, TrainerCounters)
    saved = store.read_json(LAYOUT.checkpoint_file(1, checkpoint.STATE_FILE))["counters"]
    assert saved["quarantined_shards"] == 1 and saved["trained_samples"] == 8
    with pytest.raises(ValueError, match="unknown trainer counters"):
        TrainerCounters.from_json({"dropped_sampels": 3})
    assert TrainerCounters.from_json({"dropped_samples": 3}).trained_samples == 0  # an older checkpoint


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_alone(tmp_path):
    run_uri, store = prepared(tmp_path, "train.lora_rank=4", "train.lora_alpha=8")
    write_groups(store, 0, 2)
    cfg = load_run_config(store)
    trainer = build_run_trainer(run_uri, cfg)
    trainer.start()
    batch = trainer.source.next_batch(trainer.state)
    trainer.step(batch.samples, batch.dropped)
    trainer.save_checkpoint()
    files = {rel.rsplit("/", 1)[-1]: rel for rel in store.find(LAYOUT.checkpoint_dir(1))}
    assert checkpoint.ADAPTER_FILE in files and checkpoint.MODEL_FILE not in files
    saved = st_load(store.read_bytes(files[checkpoint.ADAPTER_FILE]))
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(trained) > 0 and all("lora_" in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in trained.values())
    osd = torch.load(io.BytesIO(store.read_bytes(files[checkpoint.OPTIMIZER_FILE])), weights_only=False)["optimizer"]
    assert len(osd["state"]) == len(trained)  # AdamW moments of the adapter only
    again = build_run_trainer(run_uri, cfg)
    assert again.state.step == 1
    restored = {n: p for n, p in again.model.named_parameters() if p.requires_grad}
    assert restored.keys() == trained.keys()
    assert all(torch.equal(restored[n], trained[n]) for n in trained)
    base = [n for n, p in again.model.named_parameters() if not p.requires_grad][0]
    moved = dict(trainer.model.named_parameters())
    assert torch.equal(dict(again.model.named_parameters())[base], moved[base])  # the base from init_model


def test_a_checkpoint_sink_checkpoints_without_publishing(tmp_path):
    run_uri, store = prepared(tmp_path, "train.checkpoint_every=2", "train.steps=3")
    write_groups(store, 0, 6)
    cfg = load_run_config(store)
    parts = load_parts(store.url(LAYOUT.init_model), cfg, restore_from=store)
    trainer = build_run_trainer(run_uri, cfg)
    trainer = Trainer(parts, trainer.source, CheckpointSink(), store, cfg)
    trainer.fit()
    assert checkpoint.committed_steps(store) == [2, 3] and store.latest_version() is None
    assert store.done() and store.read_json(LAYOUT.done)["counters"]["trained_samples"] == 3 * 2 * 4


def test_an_exhausted_source_ends_fit_and_an_empty_batch_is_a_skipped_step(tmp_path):
    run_uri, store = prepared(tmp_path, "train.steps=10")
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    cfg = load_run_config(store)
    seen = []
    two = groups(random.Random(0), "a", 2, 0, vocab)
    source = Listed([Batch(two), Batch([], dropped=two[:2]), Batch(two, version=7)])
    parts = load_parts(store.url(LAYOUT.init_model), cfg)
    trainer = Trainer(parts, source, NullSink(), store, cfg, on_step=lambda b, m: seen.append((b.version, m["loss"])))
    trainer.fit()
    assert [v for v, _ in seen] == [None, 7]
    assert trainer.state.step == 3 and trainer.state.version == 8  # the skipped step counted; v7 -> v8
    assert trainer.state.counters.dropped_samples == 2 and store.latest_version() is None
    records = sorted(store.find(LAYOUT.trained_dir, ".json"))
    assert [store.read_json(r)["trainer_version"] for r in records] == [0, 7]


def test_check_finite_refuses_an_update_that_poisons_the_parameters(tmp_path):
    run_uri, store = prepared(tmp_path)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    cfg = load_run_config(store)
    parts = load_parts(store.url(LAYOUT.init_model), cfg)
    with torch.no_grad():
        next(parts.model.parameters()).fill_(float("nan"))
    source = Listed([Batch(groups(random.Random(0), "a", 2, 0, vocab))])
    trainer = Trainer(parts, source, NullSink(), store, cfg, check_finite=True)
    with pytest.raises(FloatingPointError, match="non-finite"):
        trainer.fit()
    assert not store.done()


# -- nothing outside train/ reaches into the trainer ---------------------------------------------
def trainer_names(tree: ast.AST) -> set[str]:
    """Names bound to a trainer: assigned from Trainer(...)/build_run_trainer(...), or named *trainer*."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in ("Trainer", "build_run_trainer"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.Name) and "trainer" in node.id.lower():
            names.add(node.id)
    return names


def private_trainer_access(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = trainer_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            if "Trainer" in bases:
                out.append(f"{path.name}:{node.lineno} subclasses Trainer")
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in names
        ):
            out.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return out


def test_the_checker_sees_a_private_call_and_a_subclass(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("t = build_run_trainer(u, c)\nt._count_drops([], [])\nclass R(Trainer):\n    pass\n")
    assert sorted(private_trainer_access(bad)) == ["bad.py:2 t._count_drops", "bad.py:3 subclasses Trainer"]


def test_no_module_outside_train_uses_a_private_member_of_the_trainer():
    paths = [p for p in (ROOT / "areal_core").rglob("*.py") if "train" not in p.relative_to(ROOT / "areal_core").parts]
    paths += [
        *(ROOT / "tasks").rglob("*.py"),
        *(ROOT / "workflows").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
    found = [hit for p in paths for hit in private_trainer_access(p)]
    assert not found, found
