"""Asynchronous GRPO: prepare -> SFT -> run_async_rl -> evaluate.

pyflyte run workflows/grpo.py grpo
pyflyte run workflows/grpo.py grpo --overrides "train.steps=100 train.eta=0"
"""

from __future__ import annotations

from flytekit import workflow

from tasks.pipeline import Accuracy, evaluate, prepare, run_async_rl, sft


@workflow
def grpo(config: str = "configs/default.yaml", overrides: str = "", resume: bool = False) -> Accuracy:
    prepared = prepare(config=config, overrides=overrides, resume=resume)
    init_model = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    final_model = run_async_rl(run_uri=prepared.run_uri, init_model=init_model)
    return evaluate(run_uri=prepared.run_uri, final_model=final_model)
