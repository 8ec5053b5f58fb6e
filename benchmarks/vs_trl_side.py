"""The TRL side of benchmarks/vs_trl.py, run by .venv-trl's python (scripts/setup_trl_venv.sh):

    .venv-trl/bin/python benchmarks/vs_trl_side.py SPEC.json

TRL's GRPOTrainer with the spec's settings (written by vs_trl.py from our run's config: prompts in our rollout order,
sampling, optimizer, schedule, clip, LoRA, reward), its snapshots saved every spec["eval_every"] steps (timed and
left out of the figures; evaluated afterwards by vs_trl.py with our evaluator); writes OUT/result.json: wall and CPU
seconds of training, the snapshots, and each step's end (time.time(), the snapshots before it taken out).

It never imports the project's packages (whose dependencies are not in this venv, and whose root is not on sys.path):
the stdlib-only modules it needs (the schedule, gsm8k_reward, reasoning-gym entries' decode) are loaded from their
files (`_module`).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _module(rel: str) -> ModuleType:
    """The project's module in the file `rel` (areal_core/reward/math.py), imported with its parent packages as bare
    path entries: no package __init__ runs, and of the project only that file and the modules it imports itself
    load (gsm8k_reward's are stdlib-only: areal_core/reward/latex.py, math_expr.py)."""
    parts = rel.removesuffix(".py").split("/")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            package = ModuleType(name)
            package.__path__ = [str(ROOT.joinpath(*parts[:i]))]
            sys.modules[name] = package
    return importlib.import_module(".".join(parts))


def trl_reward(kind: str) -> Callable[..., list[float]]:
    """TRL's reward function for the spec's reward: gsm8k_reward, or reasoning-gym's score_answer on extract_answer
    (what task_data/reasoning_gym.py's gym_reward computes) with the entry the record carries. Stdlib-only modules
    of the project are loaded by path: the project root cannot go on sys.path here, to keep this process free of it."""

    def text(c: str | list[dict]) -> str:
        return c[0]["content"] if isinstance(c, list) else c

    if kind == "gsm8k":
        gsm8k_reward = _module("areal_core/reward/math.py").gsm8k_reward

        def reward(completions: list, answer: list[str], **_) -> list[float]:
            return [gsm8k_reward(text(c), a) for c, a in zip(completions, answer)]

        return reward
    from reasoning_gym.factory import create_dataset
    from reasoning_gym.utils import extract_answer

    decode = _module("task_data/gym_entries.py").decode
    scorers: dict[tuple, object] = {}

    def score(completion: str, rg: dict) -> float:
        key = (rg["dataset"], json.dumps(rg["config"], sort_keys=True), int(rg["seed"]))
        if key not in scorers:
            scorers[key] = create_dataset(rg["dataset"], **rg["config"], seed=key[2], size=1)
        try:
            return float(scorers[key].score_answer(extract_answer(completion), decode(rg["entry"])))
        except Exception:  # as gym_reward: a scorer that raises on the answer scores 0
            return 0.0

    def reward(completions: list, rg: list[str], **_) -> list[float]:
        return [score(text(c), json.loads(m)) for c, m in zip(completions, rg)]

    return reward


def load_policy(spec: dict) -> tuple[Any, Any]:
    """(tokenizer, model) of the spec's init folder in float32, no code of the folder run; SystemExit when TRL's
    chat template gives other prompt tokens than ours; wrapped in the spec's LoRA when it has one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["init"], trust_remote_code=False)  # no code of the folder runs
    model = AutoModelForCausalLM.from_pretrained(spec["init"], dtype=torch.float32, trust_remote_code=False)
    ids = list(
        tok.apply_chat_template(
            spec["prompts"][0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    if ids != spec["first_prompt_ids"]:
        raise SystemExit(
            f"TRL's prompt tokens differ from ours:\n{tok.decode(ids)!r}\n{tok.decode(spec['first_prompt_ids'])!r}"
        )
    if spec["lora"]:  # wrapped here (not GRPOTrainer's peft_config) so that our optimizer holds the adapter's weights
        from peft import LoraConfig, get_peft_model

        lora = spec["lora"]
        config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=0.0,
            target_modules=lora["targets"],
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    return tok, model


def optimizer_and_schedule(spec: dict, model: Any) -> tuple[Any, Any]:
    """Our optimizer (AdamW, the trainer's betas) over the trainable weights and our lr schedule (its factor loaded
    from areal_core/train/schedule.py)."""
    import torch

    lr_factor = _module("areal_core/train/schedule.py").lr_factor
    steps, lr = spec["steps"], spec["lr"]
    warmup, schedule, floor = spec["schedule"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=spec["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup, schedule, floor))
    return optimizer, scheduler


def grpo_config(spec: dict, out: Path) -> Any:
    """TRL's GRPOConfig with the spec's sampling, batch, clip, KL and schedule length, on the CPU."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        num_generations=spec["group"],
        generation_batch_size=spec["batch"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        max_completion_length=spec["max_new"],
        learning_rate=spec["lr"],
        epsilon=spec["clip"][0],
        epsilon_high=spec["clip"][1],
        beta=spec["kl"],
        max_grad_norm=spec["grad_clip"],
        shuffle_dataset=False,
        use_cpu=True,
        seed=spec["seed"],
        save_strategy="no",
        gradient_checkpointing=False,  # TRL 1.16 turns it on by default; these small models need no memory saving
        report_to="none",
        logging_steps=50,
        disable_dropout=True,
    )


class Timeline:
    """What the snapshot callback records: step -> its snapshot's folder, step -> time.time() at its end (the
    snapshots before it taken out), and the wall and CPU seconds the snapshots took (left out of the figures)."""

    def __init__(self) -> None:
        self.snaps: dict[int, str] = {}
        self.step_end: dict[int, float] = {}
        self.excluded = {"wall": 0.0, "cpu": 0.0}


def snapshot_callback(spec: dict, out: Path, tok: Any, timeline: Timeline) -> Any:
    """A TrainerCallback that saves the policy (under LoRA, the adapter) every spec["eval_every"] steps and at the
    last, into OUT/step-{N}, timing each save into `timeline`."""
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **_):
            timeline.step_end[state.global_step] = time.time() - timeline.excluded["wall"]
            if state.global_step % spec["eval_every"] == 0 or state.global_step == spec["steps"]:
                w, c = time.perf_counter(), time.process_time()
                path = out / f"step-{state.global_step}"
                model.save_pretrained(path)  # under LoRA: the adapter (merged in at evaluation)
                tok.save_pretrained(path)
                timeline.snaps[state.global_step] = str(path)
                timeline.excluded["wall"] += time.perf_counter() - w
                timeline.excluded["cpu"] += time.process_time() - c

    return Snapshot()


def trl_side(spec_path: str) -> None:
    """Runs in .venv-trl: TRL's GRPOTrainer with the spec's settings; writes result.json."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from trl import GRPOTrainer

    out = Path(spec["out"])
    tok, model = load_policy(spec)
    ds = Dataset.from_list(spec["prompts"])  # "prompt" (chat messages), and the reward's columns
    optimizers = optimizer_and_schedule(spec, model)
    timeline = Timeline()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(spec["reward"]),
        args=grpo_config(spec, out),
        train_dataset=ds,
        processing_class=tok,
        optimizers=optimizers,
        callbacks=[snapshot_callback(spec, out, tok, timeline)],
    )
    w, c = time.perf_counter(), time.process_time()
    trainer.train()
    excluded = timeline.excluded
    wall, cpu = time.perf_counter() - w - excluded["wall"], time.process_time() - c - excluded["cpu"]
    result = {"wall_s": wall, "cpu_s": cpu, "snapshots": timeline.snaps, "step_end": timeline.step_end}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    trl_side(sys.argv[1])
