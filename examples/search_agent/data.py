"""Write the search agent's questions as GSM8K-style JSONL (`train.jsonl`, `test.jsonl`), the form
`task.name: gsm8k` reads (configs/agent_search.yaml).

    python -m examples.search_agent.data --out runs/search_data --seed 1 --people 1500
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from examples.search_agent.kb import KnowledgeBase, questions, to_row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/search_data")
    ap.add_argument("--seed", type=int, default=1, help="the knowledge base's seed (the server's --seed)")
    ap.add_argument("--people", type=int, default=1500, help="its size (the server's --people)")
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--kinds", default="town,year,region", help="question kinds: town, year (one hop), region (two)")
    a = ap.parse_args()
    kb = KnowledgeBase.build(a.seed, a.people)
    train, held_out = questions(kb, a.train, a.eval, seed=a.seed, kinds=tuple(a.kinds.split(",")))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", held_out)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(to_row(q)) + "\n" for q in rows))
    print(f"{len(train)} training and {len(held_out)} held-out questions in {out}")


if __name__ == "__main__":
    main()
