"""The generated visual task: seeded scenes whose answers are right, counted in the drawn pixels;
eval scenes held out by seed; the verifier checks the final answer; the loader is registered."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from areal_core.config import RunConfig
from areal_core.vlm.images import encode_png
from task_data import load_task
from task_data.clevr import BACKGROUND, COLOURS, PLURAL, clevr_reward, generate, record_images
from tests.conftest import ROOT


def components(pixels: np.ndarray) -> list[tuple[tuple[int, int, int], float]]:
    """(colour, fill ratio of its bounding box) per 4-connected blob of one exact colour."""
    h, w, _ = pixels.shape
    seen = np.zeros((h, w), bool)
    out = []
    for y0 in range(h):
        for x0 in range(w):
            colour = tuple(int(c) for c in pixels[y0, x0])
            if seen[y0, x0] or colour == BACKGROUND:
                continue
            cells, todo = [], deque([(y0, x0)])
            seen[y0, x0] = True
            while todo:
                y, x = todo.popleft()
                cells.append((y, x))
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and tuple(pixels[ny, nx]) == colour:
                        seen[ny, nx] = True
                        todo.append((ny, nx))
            ys, xs = zip(*cells)
            box = (max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1)
            out.append((colour, len(cells) / box))
    return out


def shape_of(fill: float) -> str:
    return "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"


def answer_from_pixels(question: str, pixels: np.ndarray) -> str:
    blobs = components(pixels)
    names = {rgb: name for name, rgb in COLOURS.items()}
    assert all(c in names for c, _ in blobs)  # no stray colour: every drawn pixel belongs to an object
    shapes = [shape_of(f) for _, f in blobs]
    for colour in COLOURS:
        if question == f"How many {colour} shapes are there?":
            return str(sum(names[c] == colour for c, _ in blobs))
    for shape, plural in PLURAL.items():
        if question == f"How many {plural} are there?":
            return str(shapes.count(shape))
    for a, pa in PLURAL.items():
        for b, pb in PLURAL.items():
            if question == f"Are there more {pa} than {pb}?":
                return "yes" if shapes.count(a) > shapes.count(b) else "no"
    raise AssertionError(question)


def test_scenes_are_seeded_and_their_answers_are_right_in_the_pixels():
    train, held_out = generate(3, 60, 20, "count_colour,count_shape,compare,digit_sum")
    again, _ = generate(3, 60, 20, "count_colour,count_shape,compare,digit_sum")
    assert [r["prompt"] for r in train] == [r["prompt"] for r in again]
    assert [encode_png(record_images(r)[0]) for r in train[:8]] == [encode_png(record_images(r)[0]) for r in again[:8]]
    other, _ = generate(4, 60, 20)
    assert [r["meta"]["scene"] for r in other] != [r["meta"]["scene"] for r in train]
    # held out by scene seed
    assert not {r["meta"]["scene"]["seed"] for r in train} & {r["meta"]["scene"]["seed"] for r in held_out}
    checked = 0
    for r in train + held_out:
        final = r["answer"].removeprefix("#### ")
        assert final == r["meta"]["final"]
        pixels = np.asarray(record_images(r)[0])
        if r["meta"]["scene"]["qtype"] == "digit_sum":
            assert final == str(sum(it["digit"] for it in r["meta"]["scene"]["items"]))
            assert (pixels.min(axis=2) < 100).sum() > 20  # the digits are drawn
            continue
        assert answer_from_pixels(r["prompt"], pixels) == final, r["prompt"]
        checked += 1
    assert checked == 60
    answers = {r["meta"]["final"] for r in train}
    assert {"0", "1", "yes", "no"} <= answers  # the questions are not constant


def test_counting_answers_are_balanced_so_a_blind_policy_scores_about_one_in_five():
    from collections import Counter

    train, _ = generate(2, 2000, 0, "count_colour,count_shape", 4)
    share = {a: n / len(train) for a, n in Counter(r["meta"]["final"] for r in train).items()}
    assert set(share) == {"0", "1", "2", "3", "4"} and all(0.16 < v < 0.24 for v in share.values()), share
    # the asked colour or shape is the scene's target, and the other objects never have it
    for r in train[:200]:
        scene = r["meta"]["scene"]
        attr = "colour" if scene["qtype"] == "count_colour" else "shape"
        assert sum(it[attr] == scene["target"] for it in scene["items"]) == int(r["meta"]["final"])
        assert (scene["target"] in r["prompt"]) or (PLURAL[scene["target"]] in r["prompt"])


def test_the_verifier_checks_the_final_answer_and_the_task_is_registered():
    assert clevr_reward("I count them.\n#### 3", "#### 3")[0] == 1.0
    assert clevr_reward("#### 2", "#### 3")[0] == 0.0
    assert clevr_reward("#### Yes", "#### yes")[0] == 1.0
    assert clevr_reward("3", "#### 3")[0] == 0.0  # no final answer
    cfg = RunConfig.model_validate({"task": {"name": "clevr", "num_train": 10, "num_eval": 4, "questions": "compare"}})
    train, held_out = load_task(cfg.task, cfg.seed)
    assert len(train) == 10 and len(held_out) == 4 and all(r["prompt"].startswith("Are there") for r in train)


def test_worked_demonstrations_describe_each_cell_as_the_pixels_show_it():
    """`describe_fraction` of the training answers list the 2×2 grid in reading order before the
    final answer; each named cell holds that object in the pixels and each `none` cell is blank; the
    count read off the description is the answer. Held-out answers stay bare, and fraction 0 leaves
    every record as it was."""
    kinds = "count_colour,count_shape,compare,digit_sum"
    train, held_out = generate(5, 400, 40, kinds, 4, describe_fraction=0.3)
    plain, plain_held = generate(5, 400, 40, kinds, 4)
    assert [r["meta"] for r in train] == [r["meta"] for r in plain]  # the same scenes and questions
    assert held_out == plain_held and all(r["answer"] == f"#### {r['meta']['final']}" for r in held_out)
    worked = [r for r in train if not r["answer"].startswith("####")]
    assert 0.24 < len(worked) / len(train) < 0.36
    assert all(r["answer"] == f"#### {r['meta']['final']}" for r in plain)
    names = {rgb: name for name, rgb in COLOURS.items()}
    for r in worked:
        listing, final = r["answer"].split(" #### ")
        assert final == r["meta"]["final"] and clevr_reward(r["answer"], f"#### {final}")[0] == 1.0
        cells = listing.split(", ")
        assert len(cells) == 4
        pixels = np.asarray(record_images(r)[0])
        scene = r["meta"]["scene"]
        for i, cell in enumerate(cells):
            y, x = divmod(i, 2)
            quadrant = pixels[y * 32 : (y + 1) * 32, x * 32 : (x + 1) * 32]
            if cell == "none":
                assert (quadrant == BACKGROUND).all(), (r["prompt"], i)
            elif scene["qtype"] == "digit_sum":
                assert cell.isdigit() and (quadrant.min(axis=2) < 100).sum() > 10
            else:
                ((colour, fill),) = components(quadrant)
                assert cell == f"{names[colour]} {shape_of(fill)}", (r["prompt"], i)
        if scene["qtype"] in ("count_colour", "count_shape"):
            target = scene["target"]
            assert str(sum(target in c.split() for c in cells)) == final
    try:
        generate(5, 4, 1, kinds, 4, describe_fraction=1.5)
    except ValueError as exc:
        assert "describe_fraction" in str(exc)
    else:
        raise AssertionError("a fraction above 1 was accepted")


def test_worked_demonstrations_are_refused_where_they_cannot_work():
    """A describe_fraction on another task, or with answers cut before the list ends, is a config
    error before any work starts."""
    from areal_core.config import load_config
    from areal_core.config.base import ConfigError

    with pytest.raises(ConfigError, match="task.describe_fraction.*clevr"):
        load_config(str(ROOT / "configs/default.yaml"), ["task.describe_fraction=0.3"])
    with pytest.raises(ConfigError, match="rollout.max_new_tokens"):
        load_config(str(ROOT / "configs/vlm_shapes.yaml"), ["task.describe_fraction=0.3", "eval.max_new_tokens=32"])
    cfg = load_config(
        str(ROOT / "configs/vlm_shapes.yaml"),
        ["task.describe_fraction=0.3", "rollout.max_new_tokens=32", "eval.max_new_tokens=32"],
    )
    assert cfg.task.describe_fraction == 0.3
