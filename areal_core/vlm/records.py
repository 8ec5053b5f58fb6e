"""A prompt record's images: stored by the prepare step, named by id in `meta.image_ids`.

A task's record brings its images one of two ways (docs/vlm.md):
    meta.image_source  "pkg.module:fn", fn(record) -> PIL images or PNG/JPEG bytes (task_data/clevr.py)
    meta.images        ids already stored under the run root (put_images), or paths/URIs of PNG/JPEG files

`store_record_images(store, records)` stores them content-addressed (Layout.image) and sets
`meta.image_ids`; every role then reads the images back by id (`record_image_ids`).
"""

from __future__ import annotations

import re
from typing import Any

from areal_core.config.hooks import import_object
from areal_core.store import Store
from areal_core.vlm.images import ImageError, image_problem, put_image, put_images

IMAGE_KEYS = ("image_source", "images")
_SHA = re.compile(r"[0-9a-f]{64}")


def has_images(record: dict[str, Any]) -> bool:
    meta = record.get("meta") or {}
    return any(meta.get(k) for k in (*IMAGE_KEYS, "image_ids"))


def record_image_ids(record: dict[str, Any]) -> list[str]:
    """The ids of the record's stored images (empty for a text prompt)."""
    return list((record.get("meta") or {}).get("image_ids") or [])


def _read_file(store: Store, ref: str) -> bytes:
    """A PNG/JPEG file named in meta.images: a path relative to the run root, an absolute path or a URI."""
    if "://" in ref or ref.startswith("/"):
        import fsspec

        with fsspec.open(ref, "rb") as f:
            return f.read()
    return store.read_bytes(ref)


def _ids(store: Store, record: dict[str, Any]) -> list[str]:
    meta = record["meta"]
    if meta.get("image_source"):
        source = import_object(meta["image_source"], key="meta.image_source")
        try:
            images = list(source(record))
        except Exception as exc:  # noqa: BLE001 - the task's own code: say which source failed and how
            raise ImageError(f"meta.image_source {meta['image_source']!r} failed: {type(exc).__name__}: {exc}") from exc
        return put_images(store, images)
    ids = []
    for ref in meta.get("images") or []:
        if _SHA.fullmatch(str(ref)):
            if problem := image_problem(store, [ref]):
                raise ImageError(problem)
            ids.append(ref)
        else:
            ids.append(put_image(store, _read_file(store, str(ref))))
    return ids


def store_record_images(store: Store, records: list[dict[str, Any]]) -> int:
    """Store every record's images once (by content) and set its `meta.image_ids`; returns the
    number of records with images. ImageError (naming the record) when an image cannot be stored."""
    n = 0
    for record in records:
        if not any((record.get("meta") or {}).get(k) for k in IMAGE_KEYS):
            continue
        try:
            record["meta"]["image_ids"] = _ids(store, record)
        except (ImageError, OSError) as exc:
            raise ImageError(f"prompt {record.get('prompt_id', '?')!r}: {exc}") from None
        n += 1
    return n
