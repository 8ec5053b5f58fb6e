"""Where a search-agent run's held-out success comes from: one greedy episode per held-out question
(the run's own MCP servers, agent and per-turn budget, as the evaluate step runs it), split by the
question's hops and by whether the episode searched (a tool result came back, so the episode had more
than one turn) or answered at once; an episode that failed before any sample is its own row.

    PYTHONPATH=. .venv/bin/python benchmarks/search_agent_breakdown.py --run runs/se6k \\
        [--model init_model | final_model | v000060] [--n 100] [--out breakdown.json]

A warm start that under-uses its tools shows as a "plain" row; one that searches but miscopies
names and ids shows as a low "searched" mean (docs/benchmarks.md, "Search agent").
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from typing import Any

import torch


def breakdown(rows: list[tuple[int, bool | None, float]]) -> dict[str, dict[str, float]]:
    """(hops, searched, reward) per episode -> {"<hops>-hop searched|plain|failed": {n, share, mean}, "all": ...}.
    searched None: the episode failed before any sample. share = n / len(rows); mean = the rows' mean reward."""
    groups: dict[str, list[float]] = defaultdict(list)
    for hops, searched, reward in rows:
        kind = "failed" if searched is None else "searched" if searched else "plain"
        groups[f"{hops}-hop {kind}"].append(reward)
    total = max(len(rows), 1)
    out = {
        k: {"n": len(v), "share": round(len(v) / total, 3), "mean": round(sum(v) / len(v), 3)}
        for k, v in sorted(groups.items())
    }
    out["all"] = {"n": len(rows), "share": 1.0, "mean": round(sum(r for *_, r in rows) / total, 3)}
    return out


def model_path(name: str) -> str:
    """The store path of `name`: init_model, final_model or a weights version (v000060 or 60)."""
    from areal_core.layout import LAYOUT

    if name in (LAYOUT.init_model, LAYOUT.final_model):
        return name
    version = LAYOUT.weights_version(name) if name.startswith("v") else int(name) if name.isdigit() else None
    if version is None:
        raise SystemExit(f"--model {name!r}: not init_model, final_model or a version like v000060")
    return LAYOUT.weights_dir(version)


def score_episodes(
    engine: Any, tokenizer: Any, cfg: Any, tasks: list[dict[str, Any]]
) -> list[tuple[int, bool | None, float]]:
    """(hops, searched, reward) of one greedy episode per task, with the run's agent, MCP servers,
    tool prompt and per-turn budget (`cfg`: its RunConfig), as `evaluate.heldout_eval` plays them;
    searched: its samples hold more than one turn in all; None when it failed before any sample."""
    from areal_core.proxy.agent_workflow import workflow_class
    from areal_core.rollout.engine import SamplingParams
    from examples.search_agent.kb import from_record

    cls, extra = workflow_class(cfg.agent)
    sampling = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, greedy=True, temperature=0.0)
    workflow = cls(
        tokenizer, cfg.rollout.agent, group_size=1, sampling=sampling, tool_prompt=cfg.agent.tool_prompt, **extra
    )

    async def run_all() -> list:
        return [await workflow.run_episode(engine, t) for t in tasks]

    try:
        results = asyncio.run(run_all())
    finally:
        workflow.close()
    rows = []
    for task, result in zip(tasks, results):
        searched = sum(s.num_turns for s in result.samples) > 1 if result.samples else None
        rows.append((int(from_record(task)["meta"]["hops"]), searched, float(result.reward or 0.0)))
    return rows


def episodes(run: str, model: str, n: int) -> list[tuple[int, bool | None, float]]:
    """`score_episodes` of the run's `model` on its first `n` held-out questions."""
    from areal_core.context import load_run_config
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.store import Store

    store = Store(run)
    cfg = load_run_config(store)
    tasks = load_prompts(store, "eval")[:n]
    policy, tokenizer = load_pretrained(store.url(model_path(model)), "cpu")
    policy.eval()
    engine = TorchEngine(policy, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=cfg.seed)
    return score_episodes(engine, tokenizer, cfg, tasks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a search-agent run's store (its config, test prompts, weights)")
    from areal_core.layout import LAYOUT

    ap.add_argument("--model", default=LAYOUT.init_model, help="init_model, final_model or a weights version")
    ap.add_argument("--n", type=int, default=100, help="held-out questions, from the first")
    ap.add_argument("--out", default="", help="also write the breakdown here as JSON")
    a = ap.parse_args()
    torch.set_num_threads(1)
    result = {"run": a.run, "model": a.model, "breakdown": breakdown(episodes(a.run, a.model, a.n))}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
