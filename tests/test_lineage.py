"""Version numbers across trainer restarts (areal_core/train/lineage.py): with checkpoint_every > 1
the trainer publishes versions its newest checkpoint cannot reproduce; a restart must never
publish different weights under a number already published, and must not train tokens sampled
by the abandoned versions."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, encode_shard
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.lineage import Resume, holds_version_in, newest_published, resume_version
from tests.conftest import TINY


def test_resume_rule():
    assert resume_version(4, None, None) == Resume(4, True, None)  # nothing published yet
    assert resume_version(4, 3, 3) == Resume(4, True, None)  # checkpointed, died before publishing v4
    assert resume_version(4, 4, 4) == Resume(4, False, None)  # clean restart
    assert resume_version(4, 4, 3) == Resume(4, True, None)  # v4 complete but LATEST not yet moved
    assert resume_version(4, 6, 6) == Resume(7, True, (5, 6))  # v5, v6 cannot be reproduced


def sample(sid: str, gid: str, versions: list[int]) -> Sample:
    return Sample(sid, gid, "p", "w", [5, 6, 7, 8, 9], 2, [0, 0, 1, 1, 1], [0.0] * 5, [-1, -1, *versions])


def test_samples_holding_an_abandoned_version():
    ranges = [[5, 6]]
    assert holds_version_in(sample("a", "g", [4, 5, 5]), ranges)
    assert holds_version_in(sample("a", "g", [6, 7, 7]), ranges)
    assert not holds_version_in(sample("a", "g", [4, 4, 7]), ranges)
    assert not holds_version_in(sample("a", "g", [5, 5, 5]), [])


def test_newest_published_counts_a_complete_version_that_latest_does_not_name_yet(tmp_path):
    store = Store(str(tmp_path))
    assert newest_published(store) is None
    store.write_json("weights/v000003/MANIFEST.json", {})
    store.write_bytes("weights/v000004/model.safetensors", b"torn")  # no MANIFEST: not published
    store.write_text("weights/LATEST", "2")
    assert newest_published(store) == 3


def groups(rng: random.Random, prefix: str, count: int, version: int, vocab: int) -> list[Sample]:
    """`count` groups of 4 samples whose response tokens carry `version`, rewards varying inside
    each group (non-zero advantages)."""
    out = []
    for g in range(count):
        prompt = [rng.randrange(10, vocab) for _ in range(4)]
        for k in range(4):
            resp = [rng.randrange(10, vocab) for _ in range(rng.randint(2, 5))]
            n_p, n_r = len(prompt), len(resp)
            out.append(
                Sample(
                    sample_id=f"{prefix}{g}-{k}",
                    group_id=f"{prefix}{g}",
                    prompt_id=f"p{g}",
                    worker_id="w",
                    input_ids=prompt + resp,
                    prompt_len=n_p,
                    loss_mask=[0] * n_p + [1] * n_r,
                    behav_logprobs=[0.0] * n_p + [-5.5 + rng.uniform(-0.2, 0.2) for _ in range(n_r)],
                    versions=[-1] * n_p + [version] * n_r,
                    reward=float(k % 2),
                )
            )
    return out


def manifests(store: Store) -> dict[int, str]:
    out = {}
    for name in store.listdir("weights"):
        if name.startswith("v") and store.exists(f"weights/{name}/MANIFEST.json"):
            out[int(name[1:])] = store.read_json(f"weights/{name}/MANIFEST.json")["files"]["model.safetensors"]
    return out


def train_steps(trainer, n: int) -> None:
    for _ in range(n):
        batch = trainer.source.next_batch(trainer.state)
        assert batch.samples is not None
        trainer.step(batch.samples, batch.dropped, batch.abandoned)
    trainer.sink.drain(trainer)  # the versions published before a kill (train.background_publish)


def started(run_uri: str, cfg):
    """The run's trainer after `start()` (the resumed version published)."""
    from areal_core.train.run_trainer import build_run_trainer

    trainer = build_run_trainer(run_uri, cfg)
    trainer.start()
    return trainer


@pytest.mark.slow
def test_restart_from_an_older_checkpoint_never_reuses_a_published_version(tmp_path):
    """checkpoint_every = 3: the trainer publishes v1..v4 (checkpoint at step 3), dies; restarted,
    it publishes the checkpoint's weights as v5 (not v3 again, then a different v4), drops the
    groups sampled by v4 and finishes. A second death before the next checkpoint moves on again."""
    overrides = [*TINY, f"store={tmp_path / 'run'}", "sft.enabled=false", "train.steps=6"]
    run_uri, _ = pipeline.prepare("", [*overrides, "train.checkpoint_every=3", "train.eta=10"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    vocab = json.loads(store.read_text(f"{LAYOUT.init_model}/config.json"))["vocab_size"]
    rng = random.Random(0)
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard(groups(rng, "a", 8, 0, vocab)))

    cfg = load_run_config(store)
    first = started(run_uri, cfg)
    train_steps(first, 4)  # checkpoint after step 3, then v4 published without one
    before = manifests(store)
    assert sorted(before) == [0, 1, 2, 3, 4] and checkpoint.committed_steps(store) == [3]
    del first  # killed

    # while it was down, rollout sampled 2 groups with v4; 4 more groups are from v3
    late = groups(rng, "b", 2, 4, vocab) + groups(rng, "c", 4, 3, vocab)
    store.write_bytes(LAYOUT.graded_shard("w", 1), encode_shard(late))
    second = started(run_uri, cfg)
    assert (second.state.step, second.state.version, second.state.abandoned) == (3, 5, [[4, 4]])
    assert store.latest_version() == 5
    ck = store.read_bytes(LAYOUT.checkpoint_file(3, "model.safetensors"))
    assert manifests(store)[5] == hashlib.sha256(ck).hexdigest() == before[3]  # v5 = v3's weights
    train_steps(second, 1)  # publishes v6 (no checkpoint at step 4) ...
    del second  # ... and dies again

    third = started(run_uri, cfg)  # from step 3 again: v4..v6 abandoned, its weights as v7
    assert (third.state.step, third.state.version, third.state.abandoned) == (3, 7, [[4, 6]])
    third.fit()
    done = store.read_json("DONE")
    assert done["step"] == 6 and done["version"] == 10
    after = manifests(store)
    assert {v: after[v] for v in before} == before  # nothing published before was rewritten
    assert sorted(after) == list(range(11))

    records = [store.read_json(p) for p in store.find("trainer/trained", ".json")]
    assert [r["step"] for r in records] == list(range(6))
    trained = [sid for r in records for sid, _ in r["samples"]]
    assert len(trained) == len(set(trained)) == 6 * 2 * 4
    assert not [sid for sid in trained if sid.startswith("b")]  # v4's samples never trained
    abandoned = {sid for r in records for sid, _ in r.get("abandoned", [])}
    assert abandoned == {f"b{g}-{k}" for g in range(2) for k in range(4)}
    assert done["counters"]["abandoned_samples"] == 8
    assert records[3]["trainer_version"] == 7 and records[5]["trainer_version"] == 9
