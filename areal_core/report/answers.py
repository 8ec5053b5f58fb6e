"""The report's held-out answers: the first held-out questions (`Layout.heldout_answers`, written
by the evaluation after RL, `run/pipeline.py:record_answers`) with the reference, the greedy
answer before RL (init_model) and after (final_model), each marked by the task's verifier; a
VLM's question with its picture, embedded as a data: URI so the report stays one file (the
stored bytes as they are; a thumbnail of a large one).

Everything here is read from a root that may be hand-edited or half-copied: a missing or
unreadable file is "not recorded", a missing, altered or undecodable picture is skipped with a
note, and a malformed entry is left out; nothing here raises into the report.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import logging
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.store import Store

log = logging.getLogger("areal.report")

MAX_SCENES = 12  # entries shown, whatever the file holds
MAX_IMAGES = 4  # pictures shown per question
SHOWN_CHARS = 600  # of a question, reference or answer
MIME = {"PNG": "image/png", "JPEG": "image/jpeg"}
MAX_EMBED_BYTES = 256 << 10  # a larger picture (a real checkpoint's photos) is shown as a thumbnail
THUMBNAIL_PX = 256


@dataclasses.dataclass
class Answer:
    text: str
    reward: float
    correct: bool


@dataclasses.dataclass
class Scene:
    """One held-out question; `pictures`: (media type, stored bytes) per image id, None for one
    that could not be read (missing, altered or undecodable)."""

    prompt_id: str
    question: str
    reference: str
    before: Answer | None
    after: Answer | None
    pictures: list[tuple[str, bytes] | None]


@dataclasses.dataclass
class HeldoutAnswers:
    scenes: list[Scene]
    note: str = ""  # why there are none ("not recorded", "unreadable: ...")


def _answer(raw: Any) -> Answer | None:
    if not isinstance(raw, dict):
        return None
    try:
        reward = float(raw.get("reward", 0.0))
    except (TypeError, ValueError):
        reward = 0.0
    return Answer(str(raw.get("answer", "")), reward, raw.get("correct") is True)


def _picture(roots: list[Store], sha: Any) -> tuple[str, bytes] | None:
    """The stored bytes of image `sha` and their media type, checked as every reader checks them
    (they hash to the id, and decode in full as PNG/JPEG), or a PNG thumbnail of a picture over
    MAX_EMBED_BYTES; None when it cannot be shown."""
    from areal_core.vlm.images import ImageError, decode_image, encode_png, image_format, read_image_bytes

    for store in roots:
        try:
            data = read_image_bytes(store, str(sha))
            image = decode_image(data, f"image {sha}")
            if len(data) > MAX_EMBED_BYTES:  # six of them inline would make the page (and the Deck) huge
                image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                return "image/png", encode_png(image)
            return MIME[image_format(data) or "PNG"], data
        except ImageError as exc:
            if "is missing" in str(exc):
                continue  # a fork's or replay's picture lives in an ancestor root
            log.warning("report: %s", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - an unreachable store: no picture, still a report
            log.warning("report: image %s: %s: %s", str(sha)[:80], type(exc).__name__, exc)
            return None
    return None


def _roots(store: Store) -> list[Store]:
    """Where the pictures may be: the run's root, then the roots it derives from."""
    try:
        from areal_core.forks import image_roots

        return image_roots(store)
    except Exception:  # noqa: BLE001 - a damaged lineage record: the run's own root only
        return [store]


def load_answers(store: Store) -> HeldoutAnswers:
    """The run's recorded held-out answers and their pictures; never raises."""
    try:
        if not store.exists(LAYOUT.heldout_answers):
            return HeldoutAnswers([], "not recorded (the evaluation after RL records them)")
        body = json.loads(store.read_bytes(LAYOUT.heldout_answers))
    except Exception as exc:  # noqa: BLE001 - a torn or hand-edited file
        return HeldoutAnswers([], f"not recorded: {LAYOUT.heldout_answers} is unreadable ({type(exc).__name__})")
    rows = body.get("answers") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        return HeldoutAnswers([], f"not recorded: {LAYOUT.heldout_answers} holds no answers list")
    roots: list[Store] | None = None
    scenes = []
    for row in rows[:MAX_SCENES]:
        if not isinstance(row, dict):
            continue
        ids = row.get("image_ids") if isinstance(row.get("image_ids"), list) else []
        if ids and roots is None:
            roots = _roots(store)
        pictures = [_picture(roots or [store], sha) for sha in ids[:MAX_IMAGES]]
        scenes.append(
            Scene(
                str(row.get("prompt_id", "")),
                str(row.get("question", "")),
                str(row.get("reference", "")),
                _answer(row.get("before")),
                _answer(row.get("after")),
                pictures,
            )
        )
    return HeldoutAnswers(scenes, "" if scenes else "none recorded")


def _text(s: str) -> str:
    cut = s if len(s) <= SHOWN_CHARS else s[:SHOWN_CHARS] + " …"
    return f'<span class="txt">{html.escape(cut)}</span>'


def _mark(answer: Answer | None) -> str:
    if answer is None:
        return '<td class="empty">not recorded</td>'
    if answer.correct:
        mark, cls = "✓ right", "right"
    else:
        mark, cls = ("✗ wrong" if answer.reward <= 0 else f"✗ partial ({answer.reward:.2f})"), "wrong"
    shown = _text(answer.text) if answer.text.strip() else '<span class="empty">(blank)</span>'
    return f'<td class="{cls}"><b>{mark}</b><br/>{shown}</td>'


def _pictures(scene: Scene) -> str:
    out = []
    for i, pic in enumerate(scene.pictures):
        if pic is None:
            out.append('<span class="empty">picture missing or corrupt</span>')
            continue
        mime, data = pic
        alt = html.escape(f"scene {scene.prompt_id} image {i}")
        uri = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        out.append(f'<img class="scene" alt="{alt}" src="{uri}"/>')
    return "<br/>".join(out)


def section(answers: HeldoutAnswers) -> str:
    """The report's held-out answers as one table (a question per row), or the note."""
    if not answers.scenes:
        return f'<p class="empty">{html.escape(answers.note)}</p>'
    pictured = any(s.pictures for s in answers.scenes)
    head = ["question", "reference", "before RL (init_model)", "after RL (final_model)"]
    head = ["picture", *head] if pictured else head
    rows = []
    for s in answers.scenes:
        cells = [f"<td>{_pictures(s)}</td>"] if pictured else []
        cells += [f"<td>{_text(s.question)}</td>", f"<td>{_text(s.reference)}</td>", _mark(s.before), _mark(s.after)]
        rows.append(f'<tr data-prompt="{html.escape(s.prompt_id)}">{"".join(cells)}</tr>')
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f'<table class="answers"><tr>{th}</tr>{"".join(rows)}</table>'
