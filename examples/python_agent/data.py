"""Write the Python agent's tasks as GSM8K-style JSONL (`train.jsonl`, `test.jsonl`), the form
`task.name: gsm8k` reads (configs/agent_python.yaml).

    python -m examples.python_agent.data --out runs/python_data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from examples.python_agent.agent import generate, to_row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/python_data")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    a = ap.parse_args()
    train, held_out = generate(a.seed, a.train, a.eval)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", held_out)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(to_row(t)) + "\n" for t in rows))
    print(f"{len(train)} training and {len(held_out)} held-out tasks in {out}")


if __name__ == "__main__":
    main()
