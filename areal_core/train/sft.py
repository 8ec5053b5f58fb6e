"""SFT warm start: teach the initial model the answer format on the task's reference solutions
(for agent runs with `agent.sft_examples`: whole agent episodes, loss on the assistant's tokens).

Writes the HF checkpoint (model + tokenizer) to `init_model/` under the run root; that is
the policy the RL run starts from and the 'before RL' point of the evaluation. A VLM
(`model.kind: vlm`) learns from image+text demonstrations (vlm/sft.py), and its checkpoint
holds its processor (tokenizer and image processor).
"""

from __future__ import annotations

import logging
import random
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from areal_core.config.hooks import import_object
from areal_core.context import load_run_config, set_threads
from areal_core.layout import LAYOUT
from areal_core.manifest import write_local_manifest
from areal_core.models import (
    build_tiny_model,
    build_tokenizer,
    load_pretrained,
    record_prompt,
    save_pretrained,
    sft_loss,
)
from areal_core.prompts import load_prompts
from areal_core.store import Store
from areal_core.train.schedule import lr_factor
from areal_core.vlm.images import ImageCache
from areal_core.vlm.records import record_image_ids
from areal_core.vlm.sft import Demonstration, demonstration, vision_sft_loss
from areal_core.vlm_processor import VisionProcessor

log = logging.getLogger("areal.sft")


def sft_examples(
    tokenizer, records: list[dict], system: str = "", prompt_format: str = "chat"
) -> list[tuple[list[int], int]]:
    """(prompt + answer + EOS token ids, prompt length) per record; `system`: task.system_prompt,
    `prompt_format`: task.prompt_format."""
    out = []
    for r in records:
        prompt = record_prompt(tokenizer, r, system, prompt_format)
        answer = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def sft_records(records: list[dict], multi_step_fraction: float, seed: int) -> list[dict]:
    """All single-step records plus a seeded `multi_step_fraction` of the multi-step ones."""
    rng = random.Random(seed + 17)
    return [r for r in records if r["meta"].get("steps", 1) <= 1 or rng.random() < multi_step_fraction]


def agent_sft_examples(cfg, tokenizer, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Warm start for agent runs: a seeded `agent.sft_fraction` of the records as whole agent
    episodes from `agent.sft_examples` (token ids, loss mask on the assistant's tokens), the rest
    as plain answers (prompt, then answer with loss). A fraction below 1 gives a policy that
    under-uses its tools, which RL with the task's verifier then corrects."""
    episodes = import_object(cfg.agent.sft_examples, key="agent.sft_examples")
    rng = random.Random(cfg.seed + 29)
    chosen = [rng.random() < cfg.agent.sft_fraction for _ in records]
    agentic = iter(episodes(tokenizer, [r for r, c in zip(records, chosen) if c]))
    rest = [r for r, c in zip(records, chosen) if not c]
    plain = iter(sft_examples(tokenizer, rest, cfg.task.system_prompt, cfg.task.prompt_format))
    out: list[tuple[list[int], list[int]]] = []
    for c in chosen:
        if c:
            out.append(next(agentic))
        else:
            ids, plen = next(plain)
            out.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    return out


def initial_model(cfg, train: list[dict]) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) before SFT: `model.path`'s checkpoint, or the tiny model built from
    `model.*` with a tokenizer trained on the task's text (model.kind vlm: the tiny Qwen2.5-VL,
    its VisionProcessor in place of the tokenizer)."""
    if cfg.model.path:
        return load_pretrained(cfg.model.path, cfg.device)
    corpus = [r["prompt"] + "\n" + r["answer"] for r in train]
    if cfg.agent.corpus:  # the agent's own text (e.g. its tool-call format)
        corpus = list(import_object(cfg.agent.corpus, key="agent.corpus")(train))
    if cfg.model.kind == "vlm":
        from areal_core.vlm.model import build_image_processor, build_tiny_vlm, build_vlm_tokenizer

        tok = build_vlm_tokenizer(corpus, cfg.model.vocab_size)
        processor = VisionProcessor(tok, build_image_processor(cfg.model.image_size, cfg.model.patch_size))
        return build_tiny_vlm(cfg.model, processor, cfg.seed), processor
    tokenizer = build_tokenizer(corpus, cfg.model.vocab_size)
    return build_tiny_model(cfg.model, len(tokenizer), cfg.seed), tokenizer


def batch_loss(cfg, store: Store, model, tokenizer, train: list[dict]) -> Callable[[random.Random], torch.Tensor]:
    """The loss of one SFT batch drawn with `rng`: answers (agent runs: episodes) of the SFT
    records; a VLM's demonstrations with their images (read by id, encoded once per prompt)."""
    sc = cfg.sft
    records = sft_records(train, sc.multi_step_fraction, cfg.seed)
    log.info("sft on %d of %d train problems", len(records), len(train))
    if isinstance(tokenizer, VisionProcessor):
        images, demos = ImageCache([store], capacity=1024), {}

        def demo(r: dict) -> Demonstration:
            if r["prompt_id"] not in demos:
                pics = images.load(record_image_ids(r))
                demos[r["prompt_id"]] = demonstration(tokenizer, r["prompt"], pics, r["answer"], cfg.task.system_prompt)
            return demos[r["prompt_id"]]

        def vision(rng: random.Random) -> torch.Tensor:
            batch = [demo(r) for r in rng.sample(records, min(sc.batch_size, len(records)))]
            return vision_sft_loss(model, tokenizer.pad_token_id, tokenizer.image_token_id, batch)

        return vision
    if cfg.agent.sft_examples:
        examples = agent_sft_examples(cfg, tokenizer, records)
    else:
        examples = sft_examples(tokenizer, records, cfg.task.system_prompt, cfg.task.prompt_format)

    def text(rng: random.Random) -> torch.Tensor:
        return sft_loss(model, rng.sample(examples, min(sc.batch_size, len(examples))), tokenizer.pad_token_id)

    return text


def run_sft(run_uri: str) -> str:
    store = Store(run_uri)
    cfg = load_run_config(store)
    set_threads(max(cfg.threads_per_role, torch.get_num_threads()))
    train = load_prompts(store, "train")
    model, tokenizer = initial_model(cfg, train)
    sc = cfg.sft
    if sc.enabled and sc.steps:
        loss_of = batch_loss(cfg, store, model, tokenizer, train)
        rng = random.Random(cfg.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.0)

        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, sc.steps, max(sc.warmup_steps, 1), sc.schedule)
        )
        model.train()
        for step in range(sc.steps):
            loss = loss_of(rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == sc.steps - 1:
                log.info("sft step %d/%d loss %.4f", step + 1, sc.steps, loss.item())
    model.eval()
    # a half-precision checkpoint the user brought stays in its dtype when SFT did not change it (exact)
    kept = None if sc.enabled and sc.steps else getattr(model, "stored_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tokenizer, tmp, kept)
        write_local_manifest(tmp)  # every role checks init_model against it (models.load_pretrained)
        store.put_dir(tmp, LAYOUT.init_model)
    store.write_json(LAYOUT.committed(LAYOUT.init_model), {"sft_steps": sc.steps if sc.enabled else 0})
    return store.url(LAYOUT.init_model)
