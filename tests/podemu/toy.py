"""A small workflow for the harness itself: a plain task, a map task and a two-pod PyTorchJob
(kfpytorch Elastic, nnodes=2), each reporting what its pod saw."""

from __future__ import annotations

import json
import os

from flytekit import map_task, task, workflow
from flytekitplugins.kfpytorch import Elastic

SEEN = ("BATCH_JOB_ARRAY_INDEX_VAR_NAME", "PET_NNODES", "PET_NPROC_PER_NODE", "AREAL_TOY", "AREAL_CLUSTER_CONFIG")


@task(environment={"AREAL_TOY": "declared"})
def seen(x: int) -> str:
    """The environment variables of interest in this pod."""
    return json.dumps({k: os.environ.get(k) for k in SEEN} | {"x": x})


@task
def square(x: int) -> int:
    return x * x


@task(task_config=Elastic(nnodes=2, nproc_per_node=1, rdzv_configs={"timeout": 600, "join_timeout": 600}))
def ranks(n: int) -> str:
    """Every rank's (RANK, WORLD_SIZE, GROUP_RANK, pid), gathered over gloo; rank 0's is the output."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    me = [int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["GROUP_RANK"]), os.getpid()]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    dist.destroy_process_group()
    return json.dumps({"n": n, "ranks": out})


@workflow
def toy(x: int = 3) -> tuple[str, list[int], str]:
    first = seen(x=x)
    squares = map_task(square, concurrency=2)(x=[1, 2, x])
    return first, squares, ranks(n=x)
