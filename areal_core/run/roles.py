"""Command-line entry point for every role, used by the launcher and by `pyflyte run` tasks.

python -m areal_core.run.roles trainer --run-uri s3://bucket/run
python -m areal_core.run.roles rollout --run-uri runs/default --index 1
"""

from __future__ import annotations

import argparse
import json
import sys

from areal_core.logs import setup_logging
from areal_core.store import LAYOUT


def run_role(role: str, run_uri: str, index: int = 0) -> dict:
    if role == "trainer":
        from areal_core.train.trainer import run_trainer

        return run_trainer(run_uri)
    if role == "rollout":
        from areal_core.run.context import load_run_config
        from areal_core.store import Store

        if load_run_config(Store(run_uri)).rollout.agent:  # agent episodes through an in-process proxy
            from areal_core.proxy.agent import run_agent_rollout_worker

            return run_agent_rollout_worker(run_uri, index)
        from areal_core.rollout.worker import run_rollout_worker

        return run_rollout_worker(run_uri, index)
    if role == "reward":
        from areal_core.reward.worker import run_reward_worker

        return run_reward_worker(run_uri, index)
    if role == "sft":
        from areal_core.train.sft import run_sft

        return {"init_model": run_sft(run_uri)}
    raise ValueError(f"unknown role {role!r}")


ROLES = ("trainer", "rollout", "reward", "sft")


def rollout_task(run_uri: str, index: int = 0) -> int:
    """What a Flyte task of rollout worker `index` returns: the groups it started."""
    setup_logging()
    return int(run_role("rollout", run_uri, index)["groups"])


def reward_task(run_uri: str, index: int = 0) -> int:
    """What a Flyte task of reward worker `index` returns: the samples it graded."""
    setup_logging()
    return int(run_role("reward", run_uri, index)["graded"])


def trainer_task(run_uri: str) -> str:
    """What a Flyte task of the trainer returns: the final model's URI."""
    setup_logging()
    run_role("trainer", run_uri)
    return final_model_uri(run_uri)


def final_model_uri(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/{LAYOUT.final_model}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_core.run.roles")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-uri", required=True)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    setup_logging()
    result = run_role(args.role, args.run_uri, args.index)
    print(json.dumps({"role": args.role, "index": args.index, "result": result}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
