"""benchmarks/vlm_answer_breakdown.py's pure part: a worked answer is checked against the scene it
was asked about (its list cell by cell, and whether its final answer follows from its own list)."""

from __future__ import annotations

from benchmarks.vlm_answer_breakdown import breakdown, follows, worked_row
from task_data.clevr import describe, make_record


def answer(rec, text, correct):
    return {"reference": rec["answer"], "answer": text, "correct": correct}


def test_a_digit_sum_answer_that_reads_wrong_but_adds_right_follows_its_list():
    rec = make_record(11, "digit_sum", 4, describe_first=True)
    scene = rec["meta"]["scene"]
    cells = describe(scene).split(", ")
    right = worked_row(scene, rec["prompt"], rec["answer"])
    assert right == {"list_exact": True, "cells_right": 4, "cells": 4, "follows": True}
    misread = [("1" if c != "1" else "2") if c != "none" else c for c in cells]
    implied = sum(int(c) for c in misread if c.isdigit())
    row = worked_row(scene, rec["prompt"], f"{', '.join(misread)} #### {implied}")
    assert row["list_exact"] is False and row["cells_right"] == cells.count("none") and row["follows"] is True
    bad_sum = worked_row(scene, rec["prompt"], f"{', '.join(cells)} #### {rec['meta']['final'] + '1'}")
    assert bad_sum["list_exact"] is True and bad_sum["follows"] is False
    assert worked_row(scene, rec["prompt"], f"#### {rec['meta']['final']}") is None  # a direct answer has no list


def test_counting_follows_the_asked_colour_or_shape_and_the_tables_add_up():
    recs = [make_record(s, q, 4, describe_first=True) for s in (2, 4, 6) for q in ("count_colour", "count_shape")]
    for rec in recs:
        scene = rec["meta"]["scene"]
        assert follows(scene, rec["prompt"], describe(scene).split(", ")) == rec["meta"]["final"]
    answers = [answer(r, r["answer"], True) for r in recs[:4]] + [answer(r, "#### 9", False) for r in recs[4:]]
    out = breakdown(recs, answers)
    assert out["n"] == 6 and out["accuracy"] == round(4 / 6, 3) and out["worked"] == 4
    assert (out["worked_list_exact"], out["worked_cells_right"], out["worked_follows_own_list"]) == (1.0, 1.0, 1.0)
    assert sum(sum(c.values()) for c in out["confusion"].values()) == 6
    assert sum(c.get("9", 0) for c in out["confusion"].values()) == 2
