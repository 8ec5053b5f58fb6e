"""One role in a process of its own, started by a Flyte 2 role task (flyte2/roles.py):

    python -m flyte2.role rollout RUN_URI INDEX     (also: reward, trainer)

It calls the areal_core entry point the flytekit role tasks call (tasks/roles.py):
`roles.rollout_task`, `roles.reward_task` or `roles.trainer_task`, and prints what the task
returns as its last line, `{"role": ..., "index": ..., "result": ...}`. SIGTERM stops the role
the way it stops one the launcher started: its own children (reward pool, vLLM server) first.
"""

from __future__ import annotations

import json
import sys

RESULT_PREFIX = '{"role": '


def main(argv: list[str] | None = None) -> int:
    from areal_core.procs import exit_on_sigterm
    from areal_core.run import roles

    role, run_uri, index = (argv if argv is not None else sys.argv[1:])[:3]
    exit_on_sigterm()
    if role == "rollout":
        result: object = roles.rollout_task(run_uri, int(index))
    elif role == "reward":
        result = roles.reward_task(run_uri, int(index))
    elif role == "trainer":
        result = roles.trainer_task(run_uri)
    else:
        raise SystemExit(f"unknown role {role!r}; expected rollout, reward or trainer")
    print(json.dumps({"role": role, "index": int(index), "result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
