"""Images under the run root, content-addressed: `images/{sha[:2]}/{sha}` (Layout.image) holds the
PNG or JPEG bytes whose sha256 is `sha`; a shard row names its prompt's images by these ids.

    sha = put_image(store, png_bytes)        # stored once: an id already present is not rewritten
    image = read_image(store, sha)           # PIL image; ImageError when missing, altered or undecodable
    problem = image_problem(store, ids)      # None, or why a shard naming `ids` must be quarantined

Everything read back is checked: the bytes must hash to their id (a replaced or truncated file
is refused), be PNG or JPEG, stay under MAX_IMAGE_BYTES and MAX_PIXELS, and decode in full.
"""

from __future__ import annotations

import hashlib
import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable

from PIL import Image

from areal_core.layout import LAYOUT, BadName
from areal_core.store import Store, UnreadableObject

MAX_IMAGE_BYTES = 16 << 20
MAX_PIXELS = 4096 * 4096  # a decompression bomb is refused before it is decoded
FORMATS = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}


class ImageError(ValueError):
    """An image that is missing, altered or not a readable PNG/JPEG; the message says which and why."""


def image_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_format(data: bytes) -> str | None:
    return next((name for magic, name in FORMATS.items() if data.startswith(magic)), None)


def decode_image(data: bytes, what: str = "image", max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The RGB image in PNG/JPEG `data`, decoded in full; ImageError otherwise, and (from the header
    alone, before any pixel is decoded) for more than `max_pixels` (at most MAX_PIXELS) pixels."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what}: {len(data)} bytes (at most {MAX_IMAGE_BYTES})")
    fmt = image_format(data)
    if fmt is None:
        raise ImageError(f"{what}: not a PNG or JPEG ({data[:8]!r}...)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=[fmt])
            limit = min(max_pixels, MAX_PIXELS)
            if im.width * im.height > limit:
                raise ImageError(f"{what}: a {im.width}×{im.height} image has more than {limit} pixels")
            im.load()
            return im.convert("RGB")
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageError(f"{what}: undecodable {fmt} ({str(exc)[:200]})") from None


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes of `image` (the same pixels give the same bytes, so the same id)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def put_image(store: Store, data: bytes) -> str:
    """Store PNG/JPEG `data` under its sha256 (once: an id already stored is kept); returns the id."""
    decode_image(data, "image to store")
    sha = image_id(data)
    rel = LAYOUT.image(sha)
    if not store.exists(rel):
        store.write_bytes(rel, data)
    return sha


def put_images(store: Store, images: Iterable[Image.Image | bytes]) -> list[str]:
    """The ids of `images` (PIL images are stored as PNG), each stored once."""
    return [put_image(store, im if isinstance(im, bytes) else encode_png(im)) for im in images]


def read_image_bytes(store: Store, sha: str) -> bytes:
    """The stored bytes of image `sha`, checked against the id; ImageError when missing or altered."""
    try:
        rel = LAYOUT.image(sha)
    except BadName as exc:
        raise ImageError(str(exc)) from None
    try:
        data = store.read_bytes(rel, MAX_IMAGE_BYTES)
    except FileNotFoundError:
        raise ImageError(f"image {sha} is missing from {store.url(LAYOUT.images_dir)}") from None
    except UnreadableObject as exc:
        raise ImageError(f"image {sha}: {exc}") from None
    if image_id(data) != sha:
        raise ImageError(f"image {sha} is corrupt: its bytes hash to {image_id(data)}")
    return data


def read_image(store: Store, sha: str) -> Image.Image:
    return decode_image(read_image_bytes(store, sha), f"image {sha}")


class ImageCache:
    """Decoded images by id, the most recent `capacity` kept (a group's rows share their prompt's
    images); reads from the first of `stores` that holds the id (a fork's or replay's ancestors)."""

    def __init__(self, stores: list[Store], capacity: int = 256):
        self.stores, self.capacity = stores, capacity
        self._cache: OrderedDict[str, Image.Image] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sha: str) -> Image.Image:
        with self._lock:
            if sha in self._cache:
                self._cache.move_to_end(sha)
                return self._cache[sha]
        im = read_from(self.stores, sha)
        with self._lock:
            self._cache[sha] = im
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return im

    def load(self, ids: list[str] | None) -> list[Image.Image]:
        return [self.get(sha) for sha in ids or []]


def read_from(stores: list[Store], sha: str) -> Image.Image:
    """Image `sha` from the first store that has it (a missing one is looked for in the next);
    an altered or undecodable copy is an error at once."""
    missing: ImageError | None = None
    for store in stores:
        try:
            return read_image(store, sha)
        except ImageError as exc:
            if "is missing" not in str(exc):
                raise
            missing = missing or exc
    raise missing or ImageError(f"image {sha}: no store to read it from")


_VERIFIED: set[tuple[tuple[str, ...], str]] = set()  # (roots, id) already checked by this process
_VERIFIED_LOCK = threading.Lock()


def image_problem(store: Store | list[Store], ids: Iterable[str]) -> str | None:
    """Why a shard naming images `ids` cannot be trained on (the first missing, altered or
    undecodable one), or None. `store`: the run's root, or its image roots in order (a fork's
    parents, a replay's source: forks.image_roots). Each (roots, id) is checked once per process."""
    stores = store if isinstance(store, list) else [store]
    for sha in dict.fromkeys(ids):
        key = (tuple(s.uri for s in stores), sha)
        with _VERIFIED_LOCK:
            if key in _VERIFIED:
                continue
        try:
            read_from(stores, sha)
        except ImageError as exc:
            return str(exc)
        with _VERIFIED_LOCK:
            _VERIFIED.add(key)
    return None
