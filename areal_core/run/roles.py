"""Command-line entry point for every role, used by the launcher and by `pyflyte run` tasks.

python -m areal_core.run.roles trainer --run-uri s3://bucket/run
python -m areal_core.run.roles rollout --run-uri runs/default --index 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.procs import exit_on_sigterm


def run_role(role: str, run_uri: str, index: int = 0) -> dict:
    """Run `role` while holding the run's lease (run/ownership.py): the role stops with RootLost
    when another run takes the root over or the root loses its history. A role that raises leaves
    a `crash` event in the store (`record_crash`) before the exception propagates."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    try:
        return _run_role(role, run_uri, index)
    except Exception as exc:
        record_crash(run_uri, role, index, exc)
        raise


def _run_role(role: str, run_uri: str, index: int) -> dict:
    from areal_core.store import Store

    Store(run_uri).clean_temp(*LAYOUT.own_folders(role, index))  # a dead writer's (store.py); checks index
    if role == "trainer":
        return trainer_role(run_uri)
    from areal_core.context import load_run_config
    from areal_core.run.ownership import hold

    store = Store(run_uri)
    with hold(store, load_run_config(store).lease, renew=role == "sft"):
        return _role(role, run_uri, index)


def _role(role: str, run_uri: str, index: int) -> dict:
    if role == "rollout":
        from areal_core.rollout.worker import run_rollout_worker

        return run_rollout_worker(run_uri, index)
    if role == "reward":
        from areal_core.reward.worker import run_reward_worker

        return run_reward_worker(run_uri, index)
    if role == "sft":
        from areal_core.train.sft import run_sft

        return {"init_model": run_sft(run_uri)}
    raise ValueError(f"unknown role {role!r}")


def trainer_role(run_uri: str) -> dict:
    """The trainer on this process (every torchrun rank runs it), given the run's config, and on
    rank 0 the MLflow tracker and the held-out greedy accuracy (under the task's verifier, a VLM
    with its images)."""
    from areal_core.context import load_run_config, set_threads
    from areal_core.evaluate import heldout_score
    from areal_core.forks import image_roots
    from areal_core.prompts import load_prompts
    from areal_core.run.ownership import hold, renew
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store
    from areal_core.train.distributed import env_ranks
    from areal_core.train.run_trainer import run_trainer
    from areal_core.vlm.images import ImageCache

    store = Store(run_uri)
    cfg = load_run_config(store)
    set_threads(cfg.threads_per_role)
    main = env_ranks()[0] == 0
    records = load_prompts(store, "eval")[: cfg.eval.num_samples] if main else []
    images = ImageCache(image_roots(store)) if cfg.model.kind == "vlm" else None

    def evaluate(model, tokenizer) -> float:
        return heldout_score(model, tokenizer, cfg, records, images)  # eval_every is 0 for agent runs

    # rank 0 renews the lease and watches the checkpoints; the final model and DONE are written
    # only after one more check, and the lease is then marked done
    # one process per machine (local rank 0) logs the machine's system metrics
    tracker = Tracker.attach(store)
    node = f"trainer-{os.environ.get('GROUP_RANK', '0')}"
    machine = tracker.system_metrics(node) if env_ranks()[2] == 0 else contextlib.nullcontext()
    with hold(store, cfg.lease, renew=main, checkpoints=main) as lease, machine:
        out = run_trainer(run_uri, cfg, evaluate=evaluate, tracker=tracker if main else None, guard=lease.check)
        if main:
            renew(store, lease.run_id, "done", lease.claim)
        return out


ROLES = ("trainer", "rollout", "reward", "sft")


@contextlib.contextmanager
def pod_metrics(run_uri: str, node: str) -> Iterator[None]:
    """The system metrics of this machine (a worker's own pod) on the run's MLflow run, as `node`."""
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store

    with Tracker.attach(Store(run_uri)).system_metrics(node):
        yield


def rollout_task(run_uri: str, index: int = 0) -> int:
    """What a Flyte task of rollout worker `index` returns: the groups it started."""
    setup_logging()
    with pod_metrics(run_uri, f"rollout-{index}"):
        return int(run_role("rollout", run_uri, index)["groups"])


def reward_task(run_uri: str, index: int = 0) -> int:
    """What a Flyte task of reward worker `index` returns: the samples it graded."""
    setup_logging()
    with pod_metrics(run_uri, f"reward-{index}"):
        return int(run_role("reward", run_uri, index)["graded"])


def trainer_task(run_uri: str) -> str:
    """What a Flyte task of the trainer returns: the final model's URI."""
    setup_logging()
    run_role("trainer", run_uri)
    return final_model_uri(run_uri)


# what a Flyte task of each role calls (tasks/roles.py; flyte2/roles.py in a process of its own)
TASKS = {
    "rollout": rollout_task,
    "reward": reward_task,
    "trainer": lambda run_uri, index=0: trainer_task(run_uri),
}


def final_model_uri(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/{LAYOUT.final_model}"


def record_crash(run_uri: str, role: str, index: int, exc: BaseException) -> None:
    """A `crash` event in the run's store (the report and the doctor lead with it): the role, the
    exception and where it was raised. Best effort: a store that fails here changes nothing."""
    import traceback

    from areal_core.events import EventLog
    from areal_core.store import Store

    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    try:
        with EventLog(Store(run_uri, retry_s=0), role, str(index), flush_every_s=0) as ev:
            ev.emit("crash", name=f"{role}-{index}", error=f"{type(exc).__name__}: {exc}"[:1000], where=where)
    except Exception:  # noqa: BLE001 - the role's own error is what propagates
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_core.run.roles")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-uri", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--task", action="store_true", help="run and print what the role's Flyte task returns")
    args = parser.parse_args(argv)
    if args.task and args.role not in TASKS:
        parser.error(f"--task: {args.role} has no task; expected one of {', '.join(TASKS)}")
    exit_on_sigterm()  # a stopped role stops its own children (reward pool, vLLM server) first
    setup_logging()
    if args.task:  # a Flyte 2 role task's process (flyte2/roles.py): the task's entry point and result
        result: object = TASKS[args.role](args.run_uri, args.index)
    else:
        result = run_role(args.role, args.run_uri, args.index)
    print(json.dumps({"role": args.role, "index": args.index, "result": result}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
