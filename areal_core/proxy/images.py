"""A chat request's images (OpenAI `image_url` content parts) for a vision-language model: decoded
from data URIs, checked by the run store's own rules, and made the prompt's vision placeholders
and pixel values (docs/vlm.md, "Through the proxy").

    images = request_images(req.messages, limits.max_images, state.image_refusal)   # ImageRefused: a 400
    fed, mm = prompt_images(processor, fed, all_images, n_new)                        # in the turn's plan

Accepted: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or
image/jpeg) in a user message, at most `ProxyLimits.max_images` in one request, its history
included (a client resends the whole conversation). Only data URIs: the proxy never fetches a
URL, which would let a client make the server reach any address, and would make the served
prompt depend on what a third party answers. Each image is decoded in full by
`vlm.images.decode_image` (PNG or JPEG by its bytes, at most MAX_IMAGE_BYTES and MAX_PIXELS): the
checks the trainer applies when it reads the stored bytes back, so an image the proxy served is
one the trainer can rebuild. Every refusal is an `ImageRefused`, which the route answers as a 400
in the error shape before any session opens.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from areal_core.proxy.templating import TemplateError, image_parts, url_of
from areal_core.vlm.images import MAX_IMAGE_BYTES, ImageError, decode_image, image_id
from areal_core.vlm_processor import VISION_TOKENS, MMInputs, VisionProcessor

MAX_REQUEST_PIXELS = 1024 * 1024  # the default of ProxyLimits.max_image_pixels (--max-image-pixels)
MAX_ASPECT = 200  # Qwen2-VL's smart_resize refuses a more elongated image (a ValueError, not a 4xx)
MIME_TYPES = ("image/png", "image/jpeg", "image/jpg")  # the bytes decide which it is (decode_image)
_DATA_URI = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.DOTALL)
_WHITESPACE = re.compile(rb"\s+")


@dataclass
class RequestImage:
    """One decoded image of a request: its bytes as sent (stored byte for byte when the session
    is written), their sha256 (the id rows name it by) and the RGB image."""

    data: bytes
    id: str
    image: Image.Image


class ImageRefused(ValueError):
    """A request image the proxy will not serve; the route answers 400 with `code` and the message."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def data_uri_bytes(url: str, where: str) -> bytes:
    """The bytes of a base64 PNG/JPEG data URI; ImageRefused for any other URL, media type or encoding."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https", "ftp", "file"):
        raise ImageRefused(
            f"{where}: image URLs are not fetched; send the image inline as a data URI "
            "(data:image/png;base64,... or data:image/jpeg;base64,...)",
            "invalid_image_url",
        )
    m = _DATA_URI.fullmatch(url)
    if scheme != "data" or m is None:
        raise ImageRefused(f"{where}: not a data URI (data:image/png;base64,...): {url[:40]!r}", "invalid_image_url")
    mime, params, payload = m.group(1).strip().lower(), m.group(2).lower(), m.group(3)
    if mime not in MIME_TYPES:
        raise ImageRefused(f"{where}: media type {mime[:60]!r} is not image/png or image/jpeg", "invalid_image")
    if "base64" not in [p.strip() for p in params.split(";")]:
        raise ImageRefused(f"{where}: the data URI is not base64 (data:{mime};base64,...)", "invalid_image_url")
    raw = _WHITESPACE.sub(b"", payload.encode("ascii", errors="replace"))
    if len(raw) // 4 * 3 > MAX_IMAGE_BYTES:
        raise ImageRefused(f"{where}: about {len(raw) // 4 * 3} bytes (at most {MAX_IMAGE_BYTES})", "invalid_image")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{where}: the data URI's base64 is malformed", "invalid_image") from None


def decode_part(part: Any, where: str, max_pixels: int = MAX_REQUEST_PIXELS) -> RequestImage:
    url = url_of(part)
    if url is None:
        raise ImageRefused(
            f"{where}: an image_url part needs {{'image_url': {{'url': 'data:...'}}}}", "invalid_image_url"
        )
    data = data_uri_bytes(url, where)
    try:  # a few kB of PNG can hold 16 M pixels: refused from its header, before it is decoded
        image = decode_image(data, where, max_pixels)
    except ImageError as exc:
        raise ImageRefused(str(exc), "invalid_image") from None
    w, h = image.size
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise ImageRefused(f"{where}: a {w}×{h} image is more elongated than {MAX_ASPECT}:1", "invalid_image")
    return RequestImage(data, image_id(data), image)


def count_images(messages: Sequence[Any]) -> int:
    return sum(len(image_parts(_get(m, "content"))) for m in messages)


def request_images(
    messages: Sequence[Any], max_images: int, refusal: str | None, max_pixels: int = MAX_REQUEST_PIXELS
) -> list[list[RequestImage]]:
    """Each message's images, decoded and checked, in order (CPU work: the route runs it off the
    event loop). `refusal`: why this proxy takes no images (None when it does: image_refusal)."""
    n = count_images(messages)
    if n and refusal is not None:
        raise ImageRefused(refusal, "images_unsupported")
    if n > max_images:
        raise ImageRefused(f"{n} images in the request exceed the limit of {max_images}", "too_many_images")
    out: list[list[RequestImage]] = []
    for i, m in enumerate(messages):
        content = _get(m, "content")
        if image_parts(content) and _get(m, "role") != "user":
            raise ImageRefused(
                f"messages[{i}]: only user messages may hold images, not {_get(m, 'role')!r}", "invalid_image"
            )
        parts = enumerate(content if isinstance(content, list) else [])
        where = f"messages[{i}].content"
        out.append([decode_part(p, f"{where}[{j}]", max_pixels) for j, p in parts if _get(p, "type") == "image_url"])
    return out


def image_refusal(tokenizer: Any, backend: Any) -> str | None:
    """Why the proxy over `backend` cannot take images (the 400's message), or None: it can when
    the model is a VLM (its processor stands for the tokenizer) and the engine's generate takes
    `mm` (the torch engine; the continuous and remote engines take no images)."""
    if not isinstance(tokenizer, VisionProcessor):
        return "this model takes text content only: image_url parts need a vision-language model (model.kind vlm)"
    engine = getattr(backend, "engine", backend)
    if getattr(backend, "remote", False) or "mm" not in inspect.signature(engine.generate).parameters:
        return f"this proxy's engine ({type(engine).__name__}) takes no images: serve a VLM on the torch engine"
    return None


def vision_token_ids(tokenizer: Any) -> frozenset[int]:
    """The vision placeholders of a VLM's tokenizer (none for a text model): only the chat template
    writes them, for the request's image parts."""
    if not isinstance(tokenizer, VisionProcessor):
        return frozenset()
    return frozenset(int(tokenizer.tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS)


def expand_pads(ids: list[int], pad: int, counts: list[int]) -> list[int]:
    """`ids` with its k-th image pad repeated counts[k] times (the image's merged patches);
    TemplateError when the template wrote another number of pads than there are images."""
    found = ids.count(pad)
    if found != len(counts):
        raise TemplateError(f"the chat template wrote {found} image placeholders for {len(counts)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == pad:
            out += [pad] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def prompt_images(
    processor: VisionProcessor, fed: list[int], images: list[RequestImage], n_new: int
) -> tuple[list[int], MMInputs | None]:
    """(fed with its placeholders expanded, the whole prompt's images as MMInputs or None).
    `images`: every image of the prompt in order, of which the last `n_new` are the ones `fed`
    renders; the earlier ones are already expanded in the segment's tokens."""
    if not images:
        return expand_pads(fed, processor.image_token_id, []), None
    try:
        mm = processor.pixels([im.image for im in images])
    except ValueError as exc:  # e.g. smart_resize on an image that passed decode_part's checks
        raise ImageRefused(f"the model's processor refused an image: {exc}", "invalid_image") from None
    counts = processor.image_tokens(mm.image_grid_thw)
    return expand_pads(fed, processor.image_token_id, counts[len(counts) - n_new :]), mm
