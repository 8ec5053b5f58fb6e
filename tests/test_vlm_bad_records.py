"""A VLM prompt record whose image is missing, altered or not an image id: the rollout worker
drops that group with a counted, named outcome (a `drop` event with reason `bad_image`, the
heartbeat's `dropped_groups`), gives its admission back, and goes on with the next prompt; a
restarted worker meets the record again and drops it again, never a crash loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_core.config import RunConfig
from areal_core.events import EventLog, read_events
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.rollout.admission import Admission, recover_progress
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.single_turn import SingleTurnWorkflow
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.rollout.worker import BadPromptSet, RolloutLoop
from areal_core.rollout.workflow import WorkflowContext
from areal_core.store import Store
from areal_core.vlm.images import ImageCache, encode_png, put_image
from areal_core.vlm.records import store_record_images
from task_data.clevr import generate
from tests.test_vlm_model import picture, tiny

WORKER = "rollout-0"


def damaged_run(tmp_path, damage: str, bad_index: int = 1) -> tuple[Store, list[dict], str]:
    """Three stored scenes; record `bad_index`'s image damaged as `damage` (the prompt order of
    seed 0 is [2, 0, 1]: record 1 is the third group, record 2 the first). Returns the bad prompt id."""
    store = Store(str(tmp_path / "run"))
    records, _ = generate(5, 3, 1, "count_colour")
    store_record_images(store, records)
    bad = records[bad_index]
    sha = bad["meta"]["image_ids"][0]
    if damage == "missing":
        store.delete(LAYOUT.image(sha))
    elif damage == "altered":  # other valid PNG bytes under the id: they no longer hash to it
        store.write_bytes(LAYOUT.image(sha), encode_png(picture(colour=(0, 0, 200))))
    elif damage == "not an id":
        bad["meta"]["image_ids"] = ["../../config.yaml"]
    return store, records, bad["prompt_id"]


def run_loop(
    store: Store, tasks: list[dict], policy, num_groups: int, batch_groups: int = 0, max_bad: int = 64
) -> dict:
    """The rollout worker's loop over the single-turn workflow and the tiny VLM, as a (re)started
    worker runs it: progress recovered from its own shards. `batch_groups` > 0: admission on with
    η = 0 at version 0 (no trainer publishes), so at most that many groups may reach the trainer.
    Stopped after 60 s, so a worker blocked for good fails the test instead of hanging it."""
    model, processor = policy
    cfg = RunConfig.model_validate(
        {
            "model": {"kind": "vlm"},
            "train": {"packing": False},
            "rollout": {"group_size": 2, "max_new_tokens": 3, "temperature": 1.0},
        }
    )
    workflow = SingleTurnWorkflow(WorkflowContext(cfg, processor, WORKER, 0, ImageCache([store])))
    progress = recover_progress(store, WORKER)
    adm = Admission(
        num_prompts=len(tasks),
        seed=0,
        batch_groups=batch_groups or 1,
        eta=0,
        enabled=batch_groups > 0,
        progress=progress,
    )
    engine = AsyncEngine(TorchEngine(model, processor.pad_token_id, processor.eos_token_id, seed=3))
    ev = EventLog(store, "rollout", "0", flush_every_s=0)
    loop = RolloutLoop(
        workflow, engine, tasks, adm, store, WORKER, next_seq=progress.next_seq, status_id="0", events=ev
    )
    loop.max_bad_in_a_row = max_bad
    try:
        deadline = time.monotonic() + 600  # a backstop: the loop ends at num_groups
        return asyncio.run(loop.run(stop=lambda: time.monotonic() > deadline, num_groups=num_groups))
    finally:
        engine.close()
        ev.close()


def written_prompts(store: Store) -> list[str]:
    rows = [
        s
        for rel in store.find(LAYOUT.shard_dir("ungraded", WORKER), ".arrow")
        for s in decode_shard(store.read_bytes(rel))
    ]
    return sorted({s.prompt_id for s in rows})


@pytest.mark.parametrize("damage", ["missing", "altered", "not an id"])
def test_a_record_with_a_bad_image_is_a_counted_drop_and_the_worker_goes_on(tmp_path, damage):
    store, tasks, bad = damaged_run(tmp_path, damage)
    policy = tiny()
    result = run_loop(store, tasks, policy, num_groups=3)  # every prompt once (3 prompts, one worker)
    assert result["groups"] == 3
    good = sorted(t["prompt_id"] for t in tasks if t["prompt_id"] != bad)
    assert written_prompts(store) == good  # the other groups' rows were written, none of the bad one
    drops = [r for r in read_events(store) if r["kind"] == "drop"]
    assert [(d["reason"], d["n"], d["unit"], d["prompt_id"]) for d in drops] == [("bad_image", 1, "groups", bad)]
    assert drops[0]["group"] == f"{WORKER}-g0000002"
    assert "image" in drops[0]["error"]
    assert store.read_json(LAYOUT.status("rollout", "0"))["dropped_groups"] == {"bad_image": 1}
    # a restarted worker starts the dropped group again (it is in no shard), drops it again, and
    # goes on: group 5 is the bad prompt's next turn (prompt order [2, 0, 1])
    again = run_loop(store, tasks, policy, num_groups=4)
    assert again["groups"] == 6 and written_prompts(store) == good
    drops = [r for r in read_events(store) if r["kind"] == "drop"]
    assert [(d["reason"], d["group"]) for d in drops] == [("bad_image", f"{WORKER}-g{g:07d}") for g in (2, 2, 5)]
    assert store.read_json(LAYOUT.status("rollout", "0"))["dropped_groups"] == {"bad_image": 2}


def test_a_dropped_group_gives_its_admission_back(tmp_path):
    """Admission on (η = 0, B = 2: two groups at version 0) and the first group's record bad: a
    dropped group that kept its place would leave room for one good group only, and the worker
    would wait for a trainer that waits for a second; given back, the third group starts."""
    store, tasks, bad = damaged_run(tmp_path, "missing", bad_index=2)
    result = run_loop(store, tasks, tiny(), num_groups=3, batch_groups=2)
    assert result["groups"] == 3 and bad not in written_prompts(store)


def test_a_prompt_set_whose_images_are_all_gone_stops_the_worker_with_one_clear_error(tmp_path):
    """Not one bad record but images/ lost as a whole: every group would be dropped forever, so
    after `max_bad_in_a_row` bad groups in a row the worker stops and says so."""
    store, tasks, _ = damaged_run(tmp_path, "intact")
    store.delete(LAYOUT.images_dir, recursive=True)
    with pytest.raises(BadPromptSet, match=r"last 3 groups' prompt records were all bad input \(\{'bad_image': 3\}\)"):
        run_loop(store, tasks, tiny(), num_groups=3, max_bad=3)


def test_the_admission_give_back_is_bounded_by_what_was_started():
    adm = Admission(num_prompts=4, seed=0, batch_groups=2, eta=0)
    assert adm.room(0) == 2
    adm.start()
    adm.start()
    assert adm.room(0) == 0
    adm.give_back(1)
    assert adm.room(0) == 1
    with pytest.raises(ValueError, match="more groups than"):
        adm.give_back(2)


def broken_source(record: dict) -> list:
    """A task's `meta.image_source` that fails on one record."""
    raise KeyError(f"no scene for {record['prompt_id']}")


@pytest.mark.parametrize(
    "meta, why",
    [
        ({"image_source": "tests.test_vlm_bad_records:broken_source"}, "failed: KeyError: 'no scene for p1'"),
        ({"image_source": "json:loads"}, "failed: TypeError"),  # returns no images at all
        ({"images": ["0" * 64]}, "is missing"),  # an id that was never stored
        ({"images": ["pictures/none.png"]}, "No such file"),
    ],
)
def test_a_record_whose_images_cannot_be_stored_stops_the_prepare_step_naming_it(tmp_path, meta, why):
    """Before any role starts: one clear error that names the record and the reason."""
    from areal_core.vlm.images import ImageError

    store = Store(str(tmp_path / "run"))
    ok = {"prompt_id": "p0", "prompt": "q", "meta": {"images": [encode_png(picture())]}}
    ok["meta"]["images"] = [put_image(store, ok["meta"]["images"][0])]
    with pytest.raises(ImageError, match="prompt 'p1'") as err:
        store_record_images(store, [ok, {"prompt_id": "p1", "prompt": "q", "meta": meta}])
    assert why in str(err.value)


def test_a_restart_redoing_every_earlier_drop_is_not_a_damaged_prompt_set(tmp_path):
    """A restarted worker redoes every group it dropped before (none is in a shard) first, so they fail
    together: those redone drops must not count toward `max_bad_in_a_row`, or one bad record met often
    enough would crash-loop every restart."""
    store, tasks, bad = damaged_run(tmp_path, "missing")
    policy = tiny()
    assert run_loop(store, tasks, policy, num_groups=6)["groups"] == 6  # groups 2 and 5 dropped
    for started in (7, 8):  # each restart redoes the earlier drops (2 bad in a row) and goes on
        assert run_loop(store, tasks, policy, num_groups=3, max_bad=2)["groups"] == started
    assert bad not in written_prompts(store)
