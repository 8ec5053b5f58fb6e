"""`python -m flyte2 JOB ...`: run a GRPO job with the Flyte 2 SDK after checking its config here,
so a bad key or value is one line (exit status 2) and no Flyte run starts:

    python -m flyte2 grpo --overrides "train.steps=100 train.eta=0"          # local: flyte.init()
    python -m flyte2 grpo --cfg '{"train": {"eta": 0}}' --resume_run
    python -m flyte2 grpo_cluster --remote --overrides "store=s3://bucket/runs/exp1"  # flyte.init_from_config()

`flyte run --local flyte2/grpo.py grpo ...` runs the same job through the SDK's own command line;
there the job checks its config as its first step, before any other task runs (docs/flyte2.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from areal_core.config import ConfigError, RunConfig
from areal_core.config.base import one_line
from jobs.catalog import GRPO, GRPO_CLUSTER

JOBS = {job.name: job for job in (GRPO, GRPO_CLUSTER)}
SET_BY_SCHEDULE = ("kickoff_time",)  # inputs a schedule sets, not a person


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line of the jobs' inputs (jobs/catalog.py: names, defaults, docs), then how to run."""
    parser = argparse.ArgumentParser(prog="python -m flyte2", description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=list(JOBS))
    seen: set[str] = set()
    for job in JOBS.values():
        for given in job.inputs:
            if given.name in seen or given.name in SET_BY_SCHEDULE:
                continue
            seen.add(given.name)
            only = "" if all(given in j.inputs for j in JOBS.values()) else f"{job.name}: "
            if given.type is bool:
                parser.add_argument(f"--{given.name}", action="store_true", help=only + given.doc)
            elif given.type is RunConfig:
                parser.add_argument(f"--{given.name}", default="{}", help=only + given.doc)
            else:
                parser.add_argument(f"--{given.name}", default=given.default, type=given.type, help=only + given.doc)
    parser.add_argument("--remote", action="store_true", help="run on the cluster of the Flyte config")
    parser.add_argument("--name", default=None, help="the run's name")
    return parser.parse_args(argv)


def checked_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The job's inputs, the config checked as the job would check it; ConfigError in one line."""
    from flyte2.grpo import check_config

    try:
        cfg = RunConfig.model_validate(json.loads(args.cfg))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--cfg is not JSON: {exc}") from None
    except ValidationError as exc:
        raise one_line(exc, RunConfig.error_label, "", RunConfig) from None
    check_config(cfg, args.config, args.overrides, for_cluster=args.job == "grpo_cluster")
    names = [i.name for i in JOBS[args.job].inputs if i.name not in SET_BY_SCHEDULE]
    return {name: getattr(args, name) for name in names} | {"cfg": cfg}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        inputs = checked_inputs(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import flyte

    from flyte2 import grpo

    if args.remote:
        flyte.init_from_config()
    else:
        flyte.init()
    # remote: ship the whole tree (configs/*.yaml, the modules areal_core imports inside functions)
    context = {"mode": "remote", "copy_style": "all"} if args.remote else {"mode": "local"}
    run = flyte.with_runcontext(name=args.name, **context).run(getattr(grpo, args.job), **inputs)
    print(f"run: {run.url}")
    if not args.remote:
        print(f"outputs: {run.outputs()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
