"""Images in the trajectory store: content-addressed under the run root, named by a shard row's
optional `image_ids` column; a missing or altered image quarantines its shard with the reason;
shards written before the column still decode; images are read back through open_run, a fork's
parent and a replay's source."""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
from PIL import Image

from areal_core.dataset import load_images, samples_table
from areal_core.forks import ForkRef, image_roots, write_fork
from areal_core.layout import LAYOUT, BadName
from areal_core.protocol import SCHEMA, Sample, decode_shard, encode_shard, read_shard_or_quarantine, write_shard
from areal_core.store import Store
from areal_core.vlm.images import ImageError, encode_png, image_id, put_image, put_images, read_image, read_image_bytes


def picture(colour: tuple[int, int, int]) -> Image.Image:
    im = Image.new("RGB", (32, 32), (250, 250, 250))
    im.paste(colour, (4, 4, 20, 20))
    return im


def jpeg(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    picture(colour).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def sample(i: int, image_ids: list[str] | None = None) -> Sample:
    return Sample(
        sample_id=f"s{i}",
        group_id="g0",
        prompt_id="p0",
        worker_id="rollout-0",
        input_ids=[1, 2, 3, 4],
        prompt_len=2,
        loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.7],
        versions=[-1, -1, 0, 0],
        reward=1.0,
        image_ids=image_ids,
    )


def test_an_image_round_trips_byte_exact_and_is_stored_once(tmp_path):
    store = Store(str(tmp_path))
    png, jpg = encode_png(picture((200, 0, 0))), jpeg((0, 0, 200))
    a, b = put_image(store, png), put_image(store, jpg)
    assert a == image_id(png) and store.find(LAYOUT.images_dir) == sorted([LAYOUT.image(a), LAYOUT.image(b)])
    assert read_image_bytes(store, a) == png and read_image_bytes(store, b) == jpg
    assert read_image(store, a).getpixel((10, 10)) == (200, 0, 0)
    assert put_images(store, [picture((200, 0, 0)), jpg]) == [a, b]  # the same pixels: the same id, not rewritten
    assert len(store.find(LAYOUT.images_dir)) == 2
    with pytest.raises(ImageError, match="not a PNG or JPEG"):
        put_image(store, b"GIF89a....")
    for bad in ("../" + a, a.upper(), a[:63], "x" * 64):
        with pytest.raises(BadName):
            LAYOUT.image(bad)


def test_shards_carry_image_ids_and_old_shards_without_the_column_still_decode(tmp_path):
    store = Store(str(tmp_path))
    sha = put_image(store, encode_png(picture((0, 150, 0))))
    back = decode_shard(encode_shard([sample(0, [sha]), sample(1)]))
    assert [s.image_ids for s in back] == [[sha], None]
    # a shard written before the column existed: the same schema version, no image_ids
    old = pa.schema([f for f in SCHEMA if f.name != "image_ids"], metadata=SCHEMA.metadata)
    table = pa.Table.from_pylist([{k: v for k, v in row.items() if k != "image_ids"} for row in _rows()], schema=old)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, old) as w:
        w.write_table(table)
    legacy = sink.getvalue().to_pybytes()
    assert [s.image_ids for s in decode_shard(legacy)] == [None]
    store.write_bytes(LAYOUT.graded_shard("rollout-0", 0), legacy)
    write_shard(store, LAYOUT.graded_shard("rollout-0", 1), [sample(2, [sha])])
    rows = samples_table(store).to_pylist()  # open_run's table: the column, null for the old shard
    assert [r["image_ids"] for r in rows] == [None, [sha]]
    assert load_images(store, rows[1]["image_ids"])[0].getpixel((10, 10)) == (0, 150, 0)


def _rows() -> list[dict]:
    from areal_core.protocol import to_table

    return to_table([sample(9)]).to_pylist()


@pytest.mark.parametrize("damage", ["missing", "altered", "undecodable"])
def test_a_shard_naming_a_missing_or_corrupt_image_is_quarantined_with_the_reason(tmp_path, damage):
    store = Store(str(tmp_path))
    good = put_image(store, encode_png(picture((1, 2, 3))))
    png = encode_png(picture((9, 9, 9)))
    sha = image_id(png)
    if damage == "altered":
        store.write_bytes(LAYOUT.image(sha), encode_png(picture((8, 8, 8))))
    elif damage == "undecodable":
        png = png[:40]  # a truncated PNG stored under its own sha
        sha = image_id(png)
        store.write_bytes(LAYOUT.image(sha), png)
    rel = LAYOUT.graded_shard("rollout-0", 3)
    write_shard(store, rel, [sample(0, [good]), sample(1, [sha])])
    assert read_shard_or_quarantine(store, rel) is None
    [note] = store.find(LAYOUT.quarantine_dir, ".reason.json")
    reason = store.read_json(note)["reason"]
    assert (
        sha in reason and {"missing": "missing", "altered": "corrupt", "undecodable": "undecodable"}[damage] in reason
    )
    ok = LAYOUT.graded_shard("rollout-0", 4)
    write_shard(store, ok, [sample(2, [good])])
    assert read_shard_or_quarantine(store, ok)[0].image_ids == [good]


def test_images_are_found_through_a_fork_parent_and_a_replay_source(tmp_path):
    parent = Store(str(tmp_path / "parent"))
    sha = put_image(parent, encode_png(picture((5, 100, 5))))
    fork = Store(str(tmp_path / "fork"))
    write_fork(fork, ForkRef(parent=parent.uri, step=1, version=1, shards={}, workers={}))
    replay = Store(str(tmp_path / "replay"))
    replay.write_json(LAYOUT.replay_record, {"source": fork.uri, "state": "done"})
    assert load_images(replay, [sha])[0].getpixel((10, 10)) == (5, 100, 5)
    with pytest.raises(ImageError, match="missing"):
        load_images(Store(str(tmp_path / "alone")), [sha])
    for derived in (fork, replay):  # a derived run's shards naming the parent's images are not corrupt
        rel = LAYOUT.graded_shard("rollout-0", 7)
        write_shard(derived, rel, [sample(0, [sha])])
        assert read_shard_or_quarantine(derived, rel, image_roots=image_roots(derived))[0].image_ids == [sha]
    alone = Store(str(tmp_path / "alone"))
    write_shard(alone, LAYOUT.graded_shard("rollout-0", 7), [sample(0, [sha])])
    assert read_shard_or_quarantine(alone, LAYOUT.graded_shard("rollout-0", 7), image_roots=image_roots(alone)) is None
