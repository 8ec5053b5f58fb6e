"""CLEVR-like visual reasoning, generated from a seed: shapes of a few colours and sizes on a plain
background, drawn with PIL, and questions with exact answers.

    "How many red shapes are there?"          answer "#### 2"
    "How many circles are there?"             answer "#### 1"
    "Are there more circles than squares?"    answer "#### yes"
    "What is the sum of the digits shown?"    answer "#### 11"

A scene is a pure function of its scene seed (`make_scene`), and so is its picture (`render`):
the record carries the seed, and `record_images` draws the picture again wherever it is needed
(the VLM workflow stores it once, content-addressed, under the run root). Held out by scene
seed: train scenes use even seeds, eval scenes odd ones, so no eval picture is ever trained on.
Objects sit in distinct cells of a 2×2 grid and never touch, so every one can be counted in the
pixels (tests/test_vlm_clevr.py does). Shapes are drawn without anti-aliasing: each object's
pixels have exactly its colour.
"""

from __future__ import annotations

import random
import re
from typing import Any

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 64
BACKGROUND = (122, 116, 104)  # the image processors' mean (CLIP): background patches normalise to about 0
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (225, 195, 30)}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 9, "large": 13}  # half-side in pixels at IMAGE_SIZE
QUESTIONS = ("count_colour", "count_shape", "compare", "digit_sum")
GRID = 2  # 32-pixel cells at 64 px: an object spans about 2×2 merged vision tokens of the tiny VLM
SEED_STRIDE = 1_000_003  # a run seed's scenes: seed · stride + 2i (train) or + 2i + 1 (eval)
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}


def make_scene(scene_seed: int, qtype: str, max_objects: int = 4) -> dict[str, Any]:
    """The objects (shape, colour, size, centre) or, for digit_sum, the digits (value, centre).

    Counting scenes are balanced: the asked colour or shape (`target`) and its count k are drawn
    first, k uniform in 0..max_objects, then 1..max_objects objects of which exactly k have it. Drawn
    the other way round (every object's colour at random), four objects and four colours give the
    answer 0 or 1 nine times in ten, and a model that never looks at the picture scores 0.4-0.5."""
    rng = random.Random(scene_seed)
    attr = {"count_colour": "colour", "count_shape": "shape"}.get(qtype)
    target, k = None, 0
    if attr is not None:
        target = rng.choice(list(COLOURS) if attr == "colour" else SHAPES)
        k = rng.randint(0, max_objects)
    low = 2 if qtype == "digit_sum" else max(1, k)
    cells = rng.sample(range(GRID * GRID), rng.randint(low, max_objects))
    has_target = set(rng.sample(range(len(cells)), k)) if attr is not None else set()
    step = IMAGE_SIZE / GRID
    items = []
    for j, cell in enumerate(cells):
        cx, cy = (cell % GRID + 0.5) * step, (cell // GRID + 0.5) * step
        if qtype == "digit_sum":
            items.append({"digit": rng.randint(0, 9), "x": round(cx), "y": round(cy)})
            continue
        size = rng.choice(list(SIZES))
        slack = int(step / 2 - SIZES[size] - 1)
        item = {
            "shape": rng.choice(SHAPES),
            "colour": rng.choice(list(COLOURS)),
            "size": size,
            "x": round(cx) + rng.randint(-slack, slack),
            "y": round(cy) + rng.randint(-slack, slack),
        }
        if attr is not None:
            others = [v for v in (COLOURS if attr == "colour" else SHAPES) if v != target]
            item[attr] = target if j in has_target else rng.choice(others)
        items.append(item)
    scene: dict[str, Any] = {"seed": scene_seed, "qtype": qtype, "items": items}
    if target is not None:
        scene["target"] = target
    return scene


def render(scene: dict[str, Any]) -> Image.Image:
    im = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(im)
    for it in scene["items"]:
        x, y = it["x"], it["y"]
        if "digit" in it:
            font = ImageFont.load_default(size=24)
            draw.text((x, y), str(it["digit"]), fill=(0, 0, 0), font=font, anchor="mm")
            continue
        r, fill = SIZES[it["size"]], COLOURS[it["colour"]]
        if it["shape"] == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif it["shape"] == "square":
            draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return im


def ask(scene: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """(question, exact answer) about `scene`."""
    items, qtype = scene["items"], scene["qtype"]
    if qtype == "digit_sum":
        return "What is the sum of the digits shown?", str(sum(it["digit"] for it in items))
    if qtype == "count_colour":
        colour = scene.get("target") or rng.choice(list(COLOURS))
        return f"How many {colour} shapes are there?", str(sum(it["colour"] == colour for it in items))
    if qtype == "count_shape":
        shape = scene.get("target") or rng.choice(SHAPES)
        return f"How many {PLURAL[shape]} are there?", str(sum(it["shape"] == shape for it in items))
    a, b = rng.sample(SHAPES, 2)
    more = sum(it["shape"] == a for it in items) > sum(it["shape"] == b for it in items)
    return f"Are there more {PLURAL[a]} than {PLURAL[b]}?", "yes" if more else "no"


def describe(scene: dict[str, Any]) -> str:
    """The scene's grid cells in reading order, each as what it holds: `red circle`, a digit, or
    `none`; e.g. "red circle, none, blue square, red triangle"."""
    step = IMAGE_SIZE / GRID
    cells = ["none"] * (GRID * GRID)
    for it in scene["items"]:
        cell = int(it["y"] // step) * GRID + int(it["x"] // step)
        cells[cell] = str(it["digit"]) if "digit" in it else f"{it['colour']} {it['shape']}"
    return ", ".join(cells)


def make_record(scene_seed: int, qtype: str, max_objects: int, describe_first: bool = False) -> dict[str, Any]:
    """One question about one scene; `describe_first`: its demonstration lists the grid's cells
    (`describe`) before the final answer, a worked answer where the default answers at once."""
    scene = make_scene(scene_seed, qtype, max_objects)
    question, final = ask(scene, random.Random(scene_seed + 7))
    meta = {"final": final, "scene": scene, "image_source": "task_data.clevr:record_images"}
    answer = f"{describe(scene)} #### {final}" if describe_first else f"#### {final}"
    return {"prompt": question, "answer": answer, "meta": meta}


def generate(
    seed: int,
    num_train: int,
    num_eval: int,
    questions: str = ",".join(QUESTIONS),
    max_objects: int = 4,
    describe_fraction: float = 0.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records; question types cycle through `questions` (comma-separated). A seeded
    `describe_fraction` of the training records demonstrate describing the grid before answering
    (`make_record`); held-out records are scored on their final answer alone either way."""
    if not 0.0 <= describe_fraction <= 1.0:
        raise ValueError(f"clevr describe_fraction must be in [0, 1], got {describe_fraction}")
    kinds = [q.strip() for q in questions.split(",") if q.strip()]
    if not kinds or set(kinds) - set(QUESTIONS):
        raise ValueError(f"clevr questions must be among {QUESTIONS}, got {questions!r}")
    if not 1 <= max_objects <= GRID * GRID:
        raise ValueError(f"clevr max_objects must be in 1..{GRID * GRID}, got {max_objects}")
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    pick = random.Random(seed * SEED_STRIDE + 5)
    for split, n, parity in (("train", num_train, 0), ("eval", num_eval, 1)):
        for i in range(n):
            worked = split == "train" and pick.random() < describe_fraction
            rec = make_record(seed * SEED_STRIDE + 2 * i + parity, kinds[i % len(kinds)], max_objects, worked)
            rec["prompt_id"] = f"clevr-{split}-{i}"
            out[split].append(rec)
    return out["train"], out["eval"]


def record_images(record: dict[str, Any]) -> list[Image.Image]:
    """The record's picture, drawn again from its scene (the VLM workflow's `image_source`)."""
    return [render(record["meta"]["scene"])]


_FINAL = re.compile(r"####\s*([A-Za-z]+|-?\d+)")


def final_answer(text: str) -> str | None:
    found = _FINAL.findall(text)
    return found[-1].lower() if found else None


def clevr_reward(completion: str, reference: str) -> tuple[float, dict[str, Any]]:
    """1.0 when the completion's last `#### answer` equals the reference's, else 0.0 (and why)."""
    want, got = final_answer(reference), final_answer(completion)
    ok = got is not None and got == want
    return (1.0 if ok else 0.0), {"reason": "correct" if ok else f"answer {got!r}, expected {want!r}"}
