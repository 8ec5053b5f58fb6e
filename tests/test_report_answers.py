"""The report's held-out answers (report/answers.py): the evaluation before and after RL records
the first held-out questions with both greedy answers and the verifier's verdicts
(`Layout.heldout_answers`); the report shows them, a VLM's with its stored picture inline. A root
without the file, with a torn one, or with a missing or altered picture still gets its report."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import pytest

from areal_core.layout import LAYOUT
from areal_core.report.answers import load_answers, section
from areal_core.report.html import build_report, page
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.vlm.images import encode_png, put_image
from tests.conftest import TINY
from tests.test_report import CHROMIUM, open_in_chromium
from tests.test_vlm_model import picture

SCENE_IMG = re.compile(r'<img class="scene" alt="scene ([^"]*) image (\d+)" src="data:(image/[a-z]+);base64,([^"]+)"/>')


def saved_policy(store: Store, tmp_path: Path, rel: str, save) -> None:
    """`save(folder)` writes an HF model; it becomes the run's `rel` (init_model/ or final_model/)."""
    save(tmp_path / rel)
    store.put_dir(tmp_path / rel, rel)
    store.write_json(LAYOUT.committed(rel), {})


def vlm_run(tmp_path: Path) -> Store:
    """configs/vlm_shapes.yaml, shrunk: a few SFT steps make init_model answer `#### n`, and
    final_model is an untrained tiny VLM (it answers blank lines), so the answers before and
    after differ without any RL."""
    from areal_core.context import load_run_config
    from areal_core.prompts import load_prompts
    from areal_core.train.sft import initial_model, run_sft
    from areal_core.vlm.model import save_vlm

    overrides = ["task.num_train=32", "task.num_eval=8", "eval.num_samples=8", "tracking.enabled=false"]
    overrides += ["sft.steps=30", "sft.batch_size=8"]
    uri, _ = pipeline.prepare("configs/vlm_shapes.yaml", [f"store={tmp_path / 'run'}", *overrides])
    run_sft(uri)
    store = Store(uri)
    cfg = load_run_config(store).model_copy(update={"seed": 2})
    model, processor = initial_model(cfg, load_prompts(store, "train"))
    saved_policy(store, tmp_path, LAYOUT.final_model, lambda out: save_vlm(model, processor, out))
    return store


def text_run(tmp_path: Path) -> Store:
    from areal_core.context import load_run_config
    from areal_core.models import build_tiny_model, save_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.train.sft import initial_model

    uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", "eval.num_samples=8", "eval.max_new_tokens=6"])
    store = Store(uri)
    cfg = load_run_config(store)
    _, tok = initial_model(cfg, load_prompts(store, "train"))
    for seed, rel in ((1, LAYOUT.init_model), (2, LAYOUT.final_model)):
        model = build_tiny_model(cfg.model, len(tok), seed)
        saved_policy(store, tmp_path, rel, lambda out, m=model: save_pretrained(m, tok, out))
    return store


def row_of(report: str, prompt_id: str) -> str:
    return report.split(f'data-prompt="{prompt_id}"', 1)[1].split("</tr>", 1)[0]


def marks_of(report: str, prompt_id: str) -> list[tuple[str, str]]:
    """(class, mark) of the before and after cells of the question's row."""
    return re.findall(r'<td class="(right|wrong)"><b>([^<]*)</b>', row_of(report, prompt_id))


def answers_of(report: str, prompt_id: str) -> list[str]:
    """The before and after answers as the row shows them (unescaped; a blank one as "(blank)")."""
    cell = r'<td class="(?:right|wrong)"><b>[^<]*</b><br/><span class="(?:txt|empty)">([^<]*)</span>'
    return [html.unescape(c) for c in re.findall(cell, row_of(report, prompt_id))]


def as_shown(answer: str) -> str:
    return answer if answer.strip() else "(blank)"


def test_a_vlm_runs_report_shows_its_held_out_scenes_answered_before_and_after(tmp_path):
    from task_data.clevr import clevr_reward

    store = vlm_run(tmp_path)
    result = pipeline.evaluate_run(store.uri)
    recorded = store.read_json(LAYOUT.heldout_answers)
    assert recorded["scores"] == {"before": result["before"], "after": result["after"]}
    rows = recorded["answers"]
    assert len(rows) == pipeline.HELDOUT_ANSWERS == 6
    assert all(r["before"]["answer"] != r["after"]["answer"] for r in rows)  # two policies, two answers
    for r in rows:  # the verdicts are the task verifier's on the recorded answers
        assert len(r["image_ids"]) == 1 and r["question"].endswith("?") and r["reference"].startswith("####")
        for when in ("before", "after"):
            assert r[when]["correct"] == (clevr_reward(r[when]["answer"], r["reference"])[0] == 1.0)
    report = result["report"]  # what the evaluation logs and publishes
    shown = SCENE_IMG.findall(report)
    assert [(p, i, m) for p, i, m, _ in shown] == [(r["prompt_id"], "0", "image/png") for r in rows]
    for (_, _, _, data), r in zip(shown, rows):  # the stored bytes, byte for byte
        assert base64.b64decode(data) == store.read_bytes(LAYOUT.image(r["image_ids"][0]))
    for r in rows:
        marks = marks_of(report, r["prompt_id"])
        expected = [("right", "✓ right") if r[w]["correct"] else ("wrong", "✗ wrong") for w in ("before", "after")]
        assert marks == expected
        assert answers_of(report, r["prompt_id"]) == [as_shown(r["before"]["answer"]), as_shown(r["after"]["answer"])]
    assert build_report(store.uri).count('<img class="scene"') == 6  # the command line's report too


def test_a_text_runs_report_shows_its_first_problems_answered_as_text(tmp_path):
    store = text_run(tmp_path)
    pipeline.evaluate_run(store.uri)
    rows = store.read_json(LAYOUT.heldout_answers)["answers"]
    assert len(rows) == 6 and all(r["image_ids"] == [] for r in rows)
    report = build_report(store.uri)
    assert "<th>picture</th>" not in report and '<img class="scene"' not in report
    for r in rows:
        assert html.escape(r["question"]) in row_of(report, r["prompt_id"])
        assert answers_of(report, r["prompt_id"]) == [as_shown(r["before"]["answer"]), as_shown(r["after"]["answer"])]


# -- hand-made roots: every verdict shown, nothing breaks the report -----------------------------


def scene(prompt_id: str, ids: list[str], before: tuple[str, float], after: tuple[str, float]) -> dict:
    def answer(text: str, reward: float) -> dict:
        return {"answer": text, "reward": reward, "correct": reward >= 1.0}

    return {
        "prompt_id": prompt_id,
        "question": "How many <b>red</b> shapes?",
        "image_ids": ids,
        "reference": "#### 2",
        "before": answer(*before),
        "after": answer(*after),
    }


def hand_made_root(tmp_path: Path) -> tuple[Store, bytes]:
    """A root with four scenes: one intact picture, one missing, one altered after it was
    stored, and an id that is no image id."""
    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "name: scenes\n")
    good = encode_png(picture())
    ok, gone, altered = (
        put_image(store, encode_png(picture(colour=c))) for c in ((200, 30, 30), (0, 90, 0), (0, 0, 9))
    )
    store.delete(LAYOUT.image(gone))
    store.write_bytes(LAYOUT.image(altered), b"\x89PNG\r\n\x1a\n" + b"x" * 40)
    scenes = [
        scene("s-ok", [ok], ("#### 1", 0.0), ("#### 2", 1.0)),
        scene("s-gone", [gone], ("#### 2", 1.0), ("#### 2", 1.0)),
        scene("s-altered", [altered], ("#### 3", 0.0), ("#### 2 or 3", 0.5)),
        scene("s-bad-id", ["../../config.yaml"], ("x", 0.0), ("y", 0.0)),
        "not a scene",
    ]
    store.write_json(LAYOUT.heldout_answers, {"version": 1, "answers": scenes})
    return store, good


def test_the_marks_and_a_missing_or_altered_picture_in_a_hand_made_root(tmp_path):
    store, good = hand_made_root(tmp_path)
    report = build_report(store.uri)
    shown = SCENE_IMG.findall(report)
    assert [(p, base64.b64decode(d)) for p, _, _, d in shown] == [("s-ok", good)]
    assert report.count("picture missing or corrupt") == 3
    assert marks_of(report, "s-ok") == [("wrong", "✗ wrong"), ("right", "✓ right")]
    assert marks_of(report, "s-gone") == [("right", "✓ right")] * 2
    assert marks_of(report, "s-altered") == [("wrong", "✗ wrong"), ("wrong", "✗ partial (0.50)")]
    assert "How many &lt;b&gt;red&lt;/b&gt; shapes?" in report and "<b>red</b>" not in report
    assert len(load_answers(store).scenes) == 4  # the entry that is no mapping is left out


def test_a_large_picture_is_shown_as_a_thumbnail(tmp_path):
    """A real checkpoint's photo of a few MiB would make six of them a huge page: over
    MAX_EMBED_BYTES the report embeds a PNG thumbnail of it instead."""
    import random

    from PIL import Image

    from areal_core.report.answers import MAX_EMBED_BYTES, THUMBNAIL_PX
    from areal_core.vlm.images import decode_image

    rng = random.Random(0)
    noise = Image.frombytes("RGB", (400, 300), bytes(rng.getrandbits(8) for _ in range(400 * 300 * 3)))
    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "name: photo\n")
    big = put_image(store, encode_png(noise))
    assert len(store.read_bytes(LAYOUT.image(big))) > MAX_EMBED_BYTES
    store.write_json(LAYOUT.heldout_answers, {"answers": [scene("photo", [big], ("a", 0.0), ("b", 1.0))]})
    [(_, _, mime, data)] = SCENE_IMG.findall(build_report(store.uri))
    thumb = decode_image(base64.b64decode(data))
    assert mime == "image/png" and thumb.size == (THUMBNAIL_PX, THUMBNAIL_PX * 3 // 4)


@pytest.mark.parametrize(
    "body, note",
    [
        (None, "not recorded (the evaluation after RL records them)"),
        (b'{"answers": [{"prompt_id": "x"', "heldout_answers.json is unreadable (JSONDecodeError)"),
        (b'{"answers": 3}', "holds no answers list"),
        (b"[1, 2]", "holds no answers list"),
        (b'{"answers": []}', "none recorded"),
    ],
)
def test_a_root_without_a_readable_answers_file_says_not_recorded(tmp_path, body, note):
    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "name: none\n")
    if body is not None:
        store.write_bytes(LAYOUT.heldout_answers, body)
    report = build_report(store.uri)
    assert "<h2>Held-out answers before and after RL</h2>" in report and note in report
    assert note in section(load_answers(store))


def test_an_answer_entry_of_the_wrong_shape_is_shown_as_not_recorded(tmp_path):
    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "name: odd\n")
    odd = {"prompt_id": 7, "question": ["a"], "image_ids": "nope", "before": "x", "after": {"reward": "NaN?"}}
    store.write_json(LAYOUT.heldout_answers, {"answers": [odd]})
    report = build_report(store.uri)
    row = row_of(report, "7")
    assert '<td class="empty">not recorded</td>' in row and "✗ wrong" in row
    assert json.loads(store.read_text(LAYOUT.heldout_answers))["answers"][0]["prompt_id"] == 7


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_a_real_browser_draws_the_scene_and_requests_nothing(tmp_path):
    store, _ = hand_made_root(tmp_path)
    out = tmp_path / "report.html"
    out.write_text(page(build_report(store.uri)))
    requests, images = open_in_chromium(out, tmp_path / "shot.png")
    assert requests == [out.as_uri()]
    [img] = [i for i in images if i["alt"].startswith("scene ")]
    natural_w, natural_h, w, h, complete = img["size"]
    assert complete and (natural_w, natural_h) == (64, 64) and (w, h) == (128, 128) and img["spread"] > 10
