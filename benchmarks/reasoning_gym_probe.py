"""Which reasoning-gym tasks can SmolLM2-135M-Instruct learn from (issue 53's learning table)?

    PYTHONPATH=. .venv/bin/python benchmarks/reasoning_gym_probe.py [--n 50] [--max-new 128] [--only a,b]
                                  [--sample-n 8] [--group 8] [--temperature 0.7] [--out probe.json]

For each candidate dataset below (an easy config of its own settings), the held-out questions a run of
configs/smollm2_reasoning_gym.yaml would take (`task_data.reasoning_gym.load` with the config's num_train and seed,
the first --n of them), asked with reasoning-gym's default system prompt in the model's chat template:
- greedy held-out accuracy with the project's evaluator (`areal_core.evaluate.greedy_answers`, the reward
  `gym_reward`: the dataset's score_answer on reasoning_gym.utils.extract_answer) at --max-new tokens, as the share
  of answers scoring 1 and as the mean score (some datasets give partial credit), and the share of answers that hold
  an `<answer>` tag at all; the accuracy had the answers been cut at 32 / 64 / 96 tokens (re-tokenized text);
- sampled answers (--group a question at --temperature, on the first --sample-n questions): the mean reward and the
  share of mixed groups (rewards not all equal), the groups GRPO learns from.
Prints one Markdown row per dataset (and RESULT json lines), and writes --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch

from areal_core.config import load_config
from areal_core.evaluate import greedy_answers
from areal_core.models import load_pretrained, localize, record_prompt
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from task_data.reasoning_gym import gym_reward

CONFIG = "configs/smollm2_reasoning_gym.yaml"
REWARD = "task_data.reasoning_gym:gym_reward"
CUTS = (32, 64, 96)

# name -> an easy config (reasoning-gym's own settings, lowered from their defaults)
CANDIDATES: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "simple_equations": {
        "min_terms": 2,
        "max_terms": 2,
        "min_value": 1,
        "max_value": 10,
        "operators": ["+", "-"],
        "operators_weights": [0.5, 0.5],
    },
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "number_sorting": {
        "min_numbers": 3,
        "max_numbers": 4,
        "min_decimals": 0,
        "max_decimals": 0,
        "min_value": 0,
        "max_value": 50,
    },
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    "word_sorting": {"min_words": 3, "max_words": 4, "min_word_length": 3, "max_word_length": 6},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100},
    "lcm": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 30},
    "base_conversion": {"min_base": 2, "max_base": 10, "min_value": 1, "max_value": 100},
    "count_bits": {"min_n": 1, "max_n": 4095},
    "fraction_simplification": {"min_value": 1, "max_value": 50, "min_factor": 2, "max_factor": 5, "styles": ["plain"]},
    "power_function": {"min_base": -10.0, "max_base": 10.0, "min_exponent": 0, "max_exponent": 2},
    "decimal_arithmetic": {"min_num_decimal_places": 1, "max_num_decimal_places": 1, "min_terms": 2, "max_terms": 2},
    "propositional_logic": {"min_vars": 2, "max_vars": 3, "min_statements": 2, "max_statements": 3},
    "caesar_cipher": {"min_words": 2, "max_words": 3, "min_rotation": 1, "max_rotation": 5},
    "prime_factorization": {"min_value": 2, "max_value": 500},
    "coin_flip": {"min_trials": 2, "max_trials": 20},
    "count_primes": {"min_n": 1, "max_n": 100},
    "syllogism": {},
    "number_format": {"min_num_candidates": 2, "max_num_candidates": 2, "min_n": 10, "max_n": 1000},
    "bitwise_arithmetic": {"difficulty": 1},
}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cpus, torch {torch.__version__}"


def records_of(name: str, config: dict[str, Any], n: int, overrides: list[str]) -> tuple[Any, list[dict]]:
    """(the run config, its first `n` held-out records) for a run of CONFIG on `name` with `config`."""
    from task_data.registry import load_task

    gym = json.dumps([{"name": name, "config": config}])
    cfg = load_config(CONFIG, [*overrides, f"task.gym={gym}", f"task.num_eval={n}"])
    _, held = load_task(cfg.task, cfg.seed)
    return cfg, held[:n]


def sampled(model, tok, cfg: Any, records: list[dict], group: int, temperature: float, max_new: int) -> dict:
    """Mean reward and share of mixed groups of `group` sampled answers to each record."""
    engine = ContinuousEngine(model, tok.pad_token_id, tok.eos_token_id, slots=min(64, group * len(records)))
    prompts = [record_prompt(tok, r, cfg.task.system_prompt, cfg.task.prompt_format) for r in records]
    gens = engine.generate(
        [p for p in prompts for _ in range(group)], SamplingParams(max_new_tokens=max_new, temperature=temperature)
    )
    rewards = [
        gym_reward(tok.decode(g.token_ids, skip_special_tokens=True), records[i // group]["meta"])[0]
        for i, g in enumerate(gens)
    ]
    groups = [rewards[i : i + group] for i in range(0, len(rewards), group)]
    return {
        "sampled_mean": statistics.mean(rewards),
        "mixed_groups": sum(len(set(g)) > 1 for g in groups) / len(groups),
        "sampled_tokens": statistics.mean(len(g.token_ids) for g in gens),
    }


def probe_one(model, tok, name: str, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cfg, records = records_of(name, config, args.n, args.overrides)
    t0 = time.perf_counter()
    answers = greedy_answers(
        model,
        tok,
        records,
        args.max_new,
        len(records),
        REWARD,
        30.0,
        cfg.task.system_prompt,
        None,
        cfg.task.prompt_format,
    )
    greedy_s = time.perf_counter() - t0
    rewards = [r for _, r in answers]
    lengths = [len(tok.encode(text, add_special_tokens=False)) for text, _ in answers]
    row: dict[str, Any] = {
        "dataset": name,
        "config": config,
        "n": len(records),
        "greedy_correct": sum(r >= 1.0 for r in rewards) / len(rewards),
        "greedy_mean": statistics.mean(rewards),
        "answer_tag": sum("<answer>" in text and "</answer>" in text for text, _ in answers) / len(answers),
        "greedy_tokens_p50": statistics.median(lengths),
        "greedy_s": greedy_s,
        "example": {
            "question": records[0]["prompt"][:300],
            "reference": records[0]["answer"],
            "answer": answers[0][0][-300:],
        },
    }
    for cut in CUTS:
        if cut < args.max_new:
            texts = [tok.decode(tok.encode(t, add_special_tokens=False)[:cut]) for t, _ in answers]
            row[f"correct_at_{cut}"] = statistics.mean(
                gym_reward(t, r["meta"])[0] >= 1.0 for t, r in zip(texts, records)
            )
    if args.sample_n:
        t0 = time.perf_counter()
        row.update(sampled(model, tok, cfg, records[: args.sample_n], args.group, args.temperature, args.max_new))
        row["sampled_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50, help="held-out questions per dataset")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--sample-n", type=int, default=8, help="questions sampled (0: no sampling)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated datasets of CANDIDATES (default: all)")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*", help="overrides of the config (e.g. seed=2)")
    args = parser.parse_args()
    from areal_core.logs import setup_logging

    setup_logging()
    torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    cfg = load_config(CONFIG, args.overrides)
    model, tok = load_pretrained(localize(cfg.model.path))
    model.eval()
    rows = []
    print(f"machine: {cpu_name()}; max_new {args.max_new}, {args.n} held-out questions each", flush=True)
    for name in names:
        try:
            rows.append(probe_one(model, tok, name, CANDIDATES[name], args))
        except Exception as exc:  # a dataset that refuses its config is a row, not the end of the probe
            rows.append({"dataset": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print("RESULT", json.dumps(rows[-1]), flush=True)
    cols = "| dataset | greedy correct | greedy mean score | `<answer>` given | " + " | ".join(
        f"correct if cut at {c}" for c in CUTS if c < args.max_new
    )
    print(f"\nmachine: {cpu_name()}\n{cols} | sampled mean (T {args.temperature}) | mixed groups | s (greedy) |")
    print("|---" * (cols.count("|") + 2) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['dataset']} | error: {r['error'][:80]} |")
            continue
        cuts = " | ".join(f"{r[f'correct_at_{c}']:.2f}" for c in CUTS if c < args.max_new)
        print(
            f"| {r['dataset']} | {r['greedy_correct']:.2f} | {r['greedy_mean']:.2f} | {r['answer_tag']:.2f} | {cuts} | "
            f"{r.get('sampled_mean', float('nan')):.2f} | {r.get('mixed_groups', float('nan')):.2f} | "
            f"{r['greedy_s']:.0f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": cpu_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
