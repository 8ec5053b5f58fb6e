"""Does a VLM run's model look at the picture? Held-out greedy accuracy with each question's own
picture, with a blank one, and with another question's picture.

    PYTHONPATH=. .venv/bin/python benchmarks/vlm_image_ablation.py --run runs/vlm_bal [--model init_model]
        [--n 200] [--out ablation.json]

The run is a finished `model.kind: vlm` run (configs/vlm_shapes.yaml). The three scores use the same
questions, model and greedy decoding (`evaluate.heldout_score`), and only the pictures change:

  own      each question's picture (the run's held-out score);
  blank    a picture of the background colour alone, the same size;
  shuffled the picture of the next held-out question (a real scene, but the wrong one).

A model that reads the picture scores well above both ablations. A model that answers from the
question alone scores the same on all three.
"""

from __future__ import annotations

import sys

from PIL import Image


class SwappedImages:
    """An ImageCache stand-in: each id mapped to another picture (`mapping`), or to a blank one."""

    def __init__(self, cache, mapping: dict[str, str] | None, blank_colour: tuple[int, int, int]):
        self.cache, self.mapping, self.blank_colour = cache, mapping, blank_colour

    def load(self, ids):
        out = []
        for sha in ids or []:
            if self.mapping is None:
                im = self.cache.get(sha)
                out.append(Image.new("RGB", im.size, self.blank_colour))
            else:
                out.append(self.cache.get(self.mapping[sha]))
        return out


def main(argv: list[str] | None = None) -> None:
    from areal_core.evaluate import heldout_score
    from benchmarks.vllm_rl import cpu_name, write_result
    from benchmarks.vlm_run import open_vlm_run, vlm_run_parser
    from task_data.clevr import BACKGROUND

    args = vlm_run_parser(__doc__).parse_args(argv)
    run = open_vlm_run(args)
    cfg, records, model, tokenizer, cache = run.cfg, run.records, run.model, run.tokenizer, run.cache
    ids = [i for r in records for i in (r.get("meta") or {}).get("image_ids") or []]
    shuffled = {sha: ids[(k + 1) % len(ids)] for k, sha in enumerate(ids)}
    res = {"cpu": cpu_name(), "run": args.run, "model": args.model, "n": len(records)}
    for label, images in (
        ("own", cache),
        ("blank", SwappedImages(cache, None, BACKGROUND)),
        ("shuffled", SwappedImages(cache, shuffled, BACKGROUND)),
    ):
        res[label] = heldout_score(model, tokenizer, cfg, records, images)
        print(f"{label}: {res[label]:.3f}", flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
