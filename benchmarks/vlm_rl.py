"""Vision-language RL on CPU: a tiny Qwen2.5-VL, an SFT warm start on generated demonstrations,
then GRPO on the CLEVR-like task, in one process (issue 29; docs/vlm.md, docs/benchmarks.md).

    python benchmarks/vlm_rl.py [--config configs/vlm_clevr.yaml] [--out result.json] [KEY=VALUE ...]

The same parts as the pipeline: the tiny VLM and its processor (areal_core/vlm/model.py), the
images stored content-addressed under a run root and read back by id (vlm/images.py), the torch
engine generating with the images (behaviour log-probs), the task's verifier, and train_step
with the rows' multimodal inputs (vlm/inputs.py). Generation and training alternate on one
policy version per step (η = 0). Held-out greedy accuracy before SFT, after SFT and after RL.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any

import torch

from areal_core.config import load_config
from areal_core.protocol import Sample
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store
from areal_core.train.step import train_step
from areal_core.vlm.images import ImageCache, put_images
from areal_core.vlm.inputs import MultimodalRows
from areal_core.vlm.model import MMInputs, VisionProcessor, build_image_processor, build_tiny_vlm, build_vlm_tokenizer
from areal_core.vlm.sft import demonstration, vision_sft_loss
from datasets import load_task
from datasets.clevr import clevr_reward, record_images


class Prompts:
    """Each record's images stored once (content-addressed) and its prompt encoded once."""

    def __init__(self, store: Store, processor: VisionProcessor, system: str = ""):
        self.store, self.processor, self.system = store, processor, system
        self.images = ImageCache([store], capacity=4096)
        self._done: dict[str, tuple[list[int], MMInputs, list[str]]] = {}

    def get(self, record: dict[str, Any]) -> tuple[list[int], MMInputs, list[str]]:
        key = record["prompt_id"]
        if key not in self._done:
            ids = put_images(self.store, record_images(record))
            prompt, mm = self.processor.encode(record["prompt"], self.images.load(ids), self.system)
            self._done[key] = (prompt, mm, ids)
        return self._done[key]


def accuracy(engine: TorchEngine, prompts: Prompts, records: list[dict], batch: int = 50) -> tuple[float, list]:
    """Greedy held-out accuracy and the (question, answer given, expected) of the first few."""
    tok, correct, shown = prompts.processor.tokenizer, 0.0, []
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        enc = [prompts.get(r) for r in chunk]
        gens = engine.generate(
            [e[0] for e in enc], SamplingParams(max_new_tokens=6, greedy=True), mm=[e[1] for e in enc]
        )
        for r, g in zip(chunk, gens):
            text = tok.decode(g.token_ids, skip_special_tokens=True)
            correct += clevr_reward(text, r["answer"])[0]
            if len(shown) < 6:
                shown.append((r["prompt"], text.strip(), r["answer"]))
    return correct / len(records), shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/vlm_clevr.yaml")
    ap.add_argument("--out", default="")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(max(1, cfg.threads_per_role))
    t0 = time.time()
    train, held_out = load_task(cfg.task, cfg.seed)
    held_out = held_out[: cfg.eval.num_samples]
    tokenizer = build_vlm_tokenizer([r["prompt"] + "\n" + r["answer"] for r in train], cfg.model.vocab_size)
    processor = VisionProcessor(tokenizer, build_image_processor(cfg.model.image_size, cfg.model.patch_size))
    model = build_tiny_vlm(cfg.model, processor, cfg.seed)
    store = Store(tempfile.mkdtemp(prefix="vlm-rl-"))
    prompts = Prompts(store, processor, cfg.task.system_prompt)
    engine = TorchEngine(model, processor.pad_token_id, processor.eos_token_id, seed=cfg.seed)
    log: dict[str, Any] = {"config": args.config, "overrides": args.overrides, "threads": torch.get_num_threads()}
    log["params"] = sum(p.numel() for p in model.parameters())
    log["acc_init"], _ = accuracy(engine, prompts, held_out)
    print(f"params {log['params']}  held-out accuracy before SFT {log['acc_init']:.3f}", flush=True)

    rng = random.Random(cfg.seed)
    sc = cfg.sft
    t_sft = time.time()
    if sc.enabled and sc.steps:
        demos = {}
        opt = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.0)
        model.train()
        for step in range(sc.steps):
            batch = []
            for r in rng.sample(train, sc.batch_size):
                if r["prompt_id"] not in demos:
                    prompt, mm, ids = prompts.get(r)
                    demos[r["prompt_id"]] = demonstration(processor, r["prompt"], prompts.images.load(ids), r["answer"])
                batch.append(demos[r["prompt_id"]])
            loss = vision_sft_loss(model, processor.pad_token_id, processor.image_token_id, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == sc.steps - 1:
                print(f"sft {step + 1}/{sc.steps} loss {loss.item():.4f}", flush=True)
        model.eval()
    log["sft_s"] = round(time.time() - t_sft, 1)
    log["acc_sft"], log["answers_sft"] = accuracy(engine, prompts, held_out)
    print(f"held-out accuracy after SFT {log['acc_sft']:.3f} ({log['sft_s']} s)", flush=True)

    tc, G = cfg.train, cfg.rollout.group_size
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
    t_rl, curve, rewards = time.time(), [], []
    for step in range(tc.steps):
        chunk = rng.sample(train, tc.batch_groups)
        enc = [prompts.get(r) for r in chunk]
        model.eval()
        gens = engine.generate([e[0] for e in enc for _ in range(G)], params, mm=[e[1] for e in enc for _ in range(G)])
        samples = []
        for i, g in enumerate(gens):
            r, (prompt, _, ids) = chunk[i // G], enc[i // G]
            text = processor.tokenizer.decode(g.token_ids, skip_special_tokens=True)
            n = len(prompt)
            samples.append(
                Sample(
                    sample_id=f"{step}-{i}",
                    group_id=f"{step}-{i // G}",
                    prompt_id=r["prompt_id"],
                    worker_id="bench",
                    input_ids=prompt + g.token_ids,
                    prompt_len=n,
                    loss_mask=[0] * n + [1] * len(g.token_ids),
                    behav_logprobs=[0.0] * n + g.logprobs,
                    versions=[-1] * n + [step] * len(g.token_ids),
                    reward=clevr_reward(text, r["answer"])[0],
                    image_ids=ids,
                )
            )
        model.train()
        rows = MultimodalRows.from_samples(samples, processor, prompts.images)
        stats = train_step(model, opt, samples, cfg, processor.pad_token_id, mm=rows)
        rewards.append(stats["reward_mean"])
        if (step + 1) % args.eval_every == 0 or step == tc.steps - 1:
            model.eval()
            acc, _ = accuracy(engine, prompts, held_out)
            curve.append(
                (step + 1, round(acc, 3), round(sum(rewards[-args.eval_every :]) / len(rewards[-args.eval_every :]), 3))
            )
            print(
                f"rl {step + 1}/{tc.steps} reward {curve[-1][2]:.3f} held-out {acc:.3f} ({time.time() - t_rl:.0f} s)",
                flush=True,
            )
    model.eval()
    log["rl_s"] = round(time.time() - t_rl, 1)
    log["acc_rl"], log["answers_rl"] = accuracy(engine, prompts, held_out)
    log["curve"] = curve
    log["total_s"] = round(time.time() - t0, 1)
    log["images_stored"] = len(store.find("images"))
    print(json.dumps({k: v for k, v in log.items() if not k.startswith("answers")}), flush=True)
    for q, got, want in log["answers_rl"]:
        print(f"  {q} -> {got!r} (expected {want!r})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
