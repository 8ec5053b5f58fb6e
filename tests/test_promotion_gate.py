"""Continuous mode's promotion gate (issue 26): every k versions the trainer's version is scored on the
held-out split and the registry's champion moves to it only when it wins; the score to beat survives
a restart, a retried offer registers nothing twice, and a damaged record stops the trainer with its name."""

from __future__ import annotations

import pytest

from areal_core.config import load_config
from areal_core.layout import LAYOUT
from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained
from areal_core.online.promotion import PromotionGate
from areal_core.online.registry import aliased
from areal_core.run.tracking import mlflow_client
from areal_core.store import Store

MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1"]
NAME = "gate-policy"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    tok = build_tokenizer(["1 + 2 = 3", "user assistant"], 300)
    out = tmp_path_factory.mktemp("model") / "hf"
    save_pretrained(build_tiny_model(load_config(None, MODEL).model, len(tok), seed=1), tok, out)
    return str(out)


def champion_version(uri: str) -> str | None:
    mv = aliased(mlflow_client(uri), NAME)
    return None if mv is None else mv.version


def test_the_alias_moves_only_when_a_version_beats_the_champion(tmp_path, folder):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = Store(str(tmp_path / "run"))
    gate = PromotionGate(store, NAME, uri, min_gain=0.05)
    gate.baseline(0.40)  # the starting policy
    assert not gate.offer(2, 2, 0.43, folder)  # better, but not by more than min_gain
    assert champion_version(uri) is None
    assert gate.offer(4, 4, 0.50, folder)
    first = champion_version(uri)
    assert first is not None and gate.champion_score == 0.50
    assert not gate.offer(6, 6, 0.52, folder)  # 0.52 < 0.50 + 0.05
    assert champion_version(uri) == first
    assert gate.offer(8, 8, 0.60, folder)
    assert int(champion_version(uri)) > int(first)
    record = store.read_json(LAYOUT.promotions)
    assert record["champion_score"] == 0.60
    assert [(o["version"], o["promoted"], o["champion_score"]) for o in record["offers"]] == [
        (2, False, 0.40),
        (4, True, 0.40),
        (6, False, 0.50),
        (8, True, 0.50),
    ]
    tags = mlflow_client(uri).get_model_version(NAME, champion_version(uri)).tags
    assert tags["trainer_version"] == "8" and tags["run_root"] == store.uri


def test_a_restarted_trainer_keeps_the_score_to_beat_and_a_retried_offer_registers_once(tmp_path, folder):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = Store(str(tmp_path / "run"))
    gate = PromotionGate(store, NAME, uri)
    gate.baseline(0.30)
    assert gate.offer(2, 2, 0.45, folder)
    again = PromotionGate(store, NAME, uri)  # the trainer restarted from a checkpoint
    again.baseline(0.10)  # its resumed weights score lower: the champion's score stands
    assert again.champion_score == 0.45
    assert again.offer(2, 2, 0.45 + 1e-9, folder)  # the same version offered again (a retried step)
    versions = mlflow_client(uri).search_model_versions(f"name='{NAME}'")
    assert len(versions) == 1  # keyed by run root and version: registered once


@pytest.mark.parametrize("damage", [b"not json", b'{"champion_score": "high", "offers": []}', b'{"offers": 3}', b"[]"])
def test_a_damaged_promotion_record_is_refused_by_name(tmp_path, damage):
    store = Store(str(tmp_path / "run"))
    store.write_bytes(LAYOUT.promotions, damage)
    with pytest.raises(ValueError, match="promotions.json"):
        PromotionGate(store, NAME, f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_a_champion_from_another_run_is_not_replaced_by_a_version_that_only_beats_this_start(tmp_path, folder):
    from areal_core.online.registry import register_if_better

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_if_better(folder, NAME, uri, 0.70, None, run_name="nightly")  # champion, heldout_score 0.7000
    nightly = champion_version(uri)
    gate = PromotionGate(Store(str(tmp_path / "run")), NAME, uri)
    gate.baseline(0.40)
    assert gate.champion_score == 0.70
    assert not gate.offer(2, 2, 0.65, folder) and champion_version(uri) == nightly
    assert gate.offer(4, 4, 0.75, folder) and champion_version(uri) != nightly


def test_a_failing_registry_or_a_nan_score_is_recorded_and_promotes_nothing(tmp_path, folder):
    store = Store(str(tmp_path / "run"))
    (tmp_path / "a-file").write_text("")  # the registry's folder cannot be created under it
    gate = PromotionGate(store, NAME, f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}")
    gate.baseline(0.40)  # the registry cannot be read: the start's score stands
    assert gate.champion_score == 0.40
    assert not gate.offer(2, 2, 0.90, folder)
    assert not gate.offer(4, 4, float("nan"), folder)
    offers = store.read_json(LAYOUT.promotions)["offers"]
    assert [o["promoted"] for o in offers] == [False, False] and all(o["error"] for o in offers)
    assert "not a finite number" in offers[1]["error"] and offers[1]["score"] is None
    assert PromotionGate(store, NAME, "").champion_score == 0.40  # the record still reads back


@pytest.mark.parametrize(
    "damage", [b'{"champion_score": NaN, "offers": []}', b'{"champion_score": true, "offers": []}']
)
def test_a_non_finite_score_to_beat_is_refused(tmp_path, damage):
    store = Store(str(tmp_path / "run"))
    store.write_bytes(LAYOUT.promotions, damage)
    with pytest.raises(ValueError, match="is damaged"):
        PromotionGate(store, NAME, "")


# -- issue 46: a gate that cannot demote, and never waits on a dead registry -------------------------
def test_a_champion_moved_by_hand_since_the_baseline_is_the_bar(tmp_path, folder):
    """The gate's baseline is 0.50; the champion is then moved by hand to a 0.90 version: an offer
    of 0.60 beats the baseline but not the champion, and moves nothing."""
    from areal_core.online.registry import register_if_better

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    gate = PromotionGate(Store(str(tmp_path / "run")), NAME, uri)
    gate.baseline(0.50)
    register_if_better(folder, NAME, uri, 0.90, None, run_name="by-hand")  # heldout_score 0.9000, champion
    hand = champion_version(uri)
    assert not gate.offer(2, 2, 0.60, folder) and champion_version(uri) == hand
    assert gate.offer(4, 4, 0.95, folder) and champion_version(uri) != hand


def test_a_registry_down_at_the_baseline_still_protects_a_champion_that_appears_later(tmp_path, folder):
    from areal_core.online.registry import register_if_better

    down = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    (tmp_path / "a-file").write_text("")
    store = Store(str(tmp_path / "run"))
    gate = PromotionGate(store, NAME, down)
    gate.baseline(0.50)  # the registry cannot be read: the start's score
    assert gate.champion_score == 0.50
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_if_better(folder, NAME, uri, 0.90, None, run_name="other-run")
    other = champion_version(uri)
    gate = PromotionGate(store, NAME, uri)  # the registry is back (a restarted trainer reads the record)
    assert not gate.offer(2, 2, 0.60, folder) and champion_version(uri) == other


def test_a_champion_without_a_recorded_score_is_scored_before_it_can_be_replaced(tmp_path, folder):
    from areal_core.online.registry import create_version, promote
    from areal_core.run.tracking import new_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow_client(uri)
    run_id = new_run(client, "hand", "hand")
    mv = create_version(client, NAME, run_id, "model", folder, {"kind": "hand"}, "by hand", "no score")
    promote(client, NAME, mv.version)
    gate = PromotionGate(Store(str(tmp_path / "run")), NAME, uri)
    gate.baseline(0.10)
    assert not gate.offer(2, 2, 0.70, folder)  # no scorer: an unscored champion is never replaced
    offers = Store(str(tmp_path / "run")).read_json(LAYOUT.promotions)["offers"]
    assert "no recorded held-out score" in offers[-1]["refused"]
    seen = []

    def scorer(model_uri: str) -> float:
        seen.append(model_uri)
        return 0.80

    assert not gate.offer(4, 4, 0.75, folder, score_current=scorer) and champion_version(uri) == mv.version
    assert seen == [f"models:/{NAME}/{mv.version}"]
    assert client.get_model_version(NAME, mv.version).tags["heldout_score"] == "0.8000"  # measured once
    assert gate.offer(6, 6, 0.85, folder, score_current=scorer) and len(seen) == 1


def test_the_alias_is_not_moved_when_the_champion_changed_during_the_offer(tmp_path, folder, monkeypatch):
    """Compare-and-set: while the candidate registers, another writer moves the champion; the
    offer leaves the alias where the other writer put it."""
    from areal_core.online import registry

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    gate = PromotionGate(Store(str(tmp_path / "run")), NAME, uri)
    gate.baseline(0.10)
    original = registry.create_version
    moved = []

    def racing(client, name, *args, **kwargs):
        if not moved:  # another writer registers and promotes its own version first
            theirs = original(client, name, *args, **kwargs)
            registry.promote(client, name, theirs.version)
            moved.append(theirs.version)
        return original(client, name, *args, **kwargs)

    monkeypatch.setattr(registry, "create_version", racing)
    assert not gate.offer(2, 2, 0.50, folder)
    assert champion_version(uri) == moved[0]
    assert "moved" in Store(str(tmp_path / "run")).read_json(LAYOUT.promotions)["offers"][-1]["refused"]


def test_a_failing_registry_opens_the_breaker_and_later_offers_do_not_call_it(tmp_path, folder, monkeypatch):
    from areal_core.online import registry

    calls = []

    def down(*args, **kwargs):
        calls.append(1)
        raise ConnectionError("registry unreachable")

    monkeypatch.setattr(registry, "register_if_better", down)
    store = Store(str(tmp_path / "run"))
    gate = PromotionGate(store, NAME, f"sqlite:///{tmp_path / 'mlflow.db'}")
    gate.baseline(0.10)
    assert not gate.offer(2, 2, 0.90, folder) and not gate.offer(4, 4, 0.95, folder)
    assert calls == [1]  # the second offer did not wait on the registry
    offers = store.read_json(LAYOUT.promotions)["offers"]
    assert "ConnectionError" in offers[0]["error"] and "registry skipped" in offers[1]["error"]
    gate.down_until = 0.0  # the breaker's time is up: the next offer tries again
    assert not gate.offer(6, 6, 0.95, folder) and calls == [1, 1]
