"""The multimodal engine and trainer paths: the torch engine generates from image+text prompts
(prefill with the vision tokens, behaviour log-probs on the response only); the trainer's
log-probs with the images equal the engine's on the same weights; one training step on an
image batch gives a finite loss and gradients that reach the vision tower."""

from __future__ import annotations

import torch

from areal_core.config import RunConfig
from areal_core.protocol import Sample
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store
from areal_core.train.batch import collate
from areal_core.train.step import policy_logprobs, train_step
from areal_core.vlm.images import ImageCache, put_images
from areal_core.vlm.inputs import MultimodalRows
from datasets.clevr import generate, record_images
from tests.test_vlm_model import tiny


def rollouts(tmp_path, n_prompts: int = 2, group: int = 2):
    model, processor = tiny()
    store = Store(str(tmp_path))
    records, _ = generate(5, n_prompts, 1, "count_colour,compare")
    prompts, mms, ids_per = [], [], []
    for r in records:
        image_ids = put_images(store, record_images(r))
        ids, mm = processor.encode(r["prompt"], ImageCache([store]).load(image_ids))
        prompts += [ids] * group
        mms += [mm] * group
        ids_per += [image_ids] * group
    engine = TorchEngine(model, processor.pad_token_id, processor.eos_token_id, seed=3)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), mm=mms)
    samples = [
        Sample(
            sample_id=f"s{i}",
            group_id=f"g{i // group}",
            prompt_id=f"p{i // group}",
            worker_id="rollout-0",
            input_ids=p + g.token_ids,
            prompt_len=len(p),
            loss_mask=[0] * len(p) + [1] * len(g.token_ids),
            behav_logprobs=[0.0] * len(p) + g.logprobs,
            versions=[-1] * len(p) + g.versions,
            reward=float(i % 2),
            image_ids=image_ids,
        )
        for i, (p, g, image_ids) in enumerate(zip(prompts, gens, ids_per))
    ]
    return model, processor, store, samples


def test_trainer_logprobs_with_images_equal_the_engines(tmp_path):
    model, processor, store, samples = rollouts(tmp_path)
    assert len({len(s.input_ids) for s in samples}) > 1  # prompts and responses of different lengths: padding differs
    cfg = RunConfig()
    batch = collate(samples, processor.pad_token_id)
    rows = MultimodalRows.from_samples(samples, processor, ImageCache([store]))
    with torch.no_grad():
        logp = policy_logprobs(model, batch, None, cfg, processor.pad_token_id, mm=rows)
        without = policy_logprobs(model, batch, None, cfg, processor.pad_token_id)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp[mask], batch.behav_logprobs[mask], atol=2e-4, rtol=1e-4)
    assert (without[mask] - batch.behav_logprobs[mask]).abs().max() > 1e-3  # the images matter
    sub = torch.tensor([3, 1])  # any subset of rows, in any order
    with torch.no_grad():
        part = policy_logprobs(model, batch, sub, cfg, processor.pad_token_id, mm=rows)
    torch.testing.assert_close(part, logp[sub], atol=1e-5, rtol=1e-5)


def test_one_train_step_on_an_image_batch_gives_finite_loss_and_gradients(tmp_path):
    model, processor, store, samples = rollouts(tmp_path)
    cfg = RunConfig.model_validate({"train": {"packing": False}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = MultimodalRows.from_samples(samples, processor, ImageCache([store]))
    stats = train_step(model, opt, samples, cfg, processor.pad_token_id, mm=rows)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    vision = [p.grad for n, p in model.named_parameters() if ".visual." in f".{n}" and p.grad is not None]
    assert vision and all(torch.isfinite(g).all() for g in vision) and any(g.abs().sum() > 0 for g in vision)


def test_vision_sft_loss_sees_the_images_and_falls_when_trained(tmp_path):
    from areal_core.vlm.sft import demonstration, vision_sft_loss

    model, processor = tiny()
    records, _ = generate(7, 4, 1, "count_colour")
    demos = [demonstration(processor, r["prompt"], record_images(r), f"#### {r['answer']}") for r in records]
    assert all(d.mm is not None and 0 < d.prompt_len < len(d.ids) for d in demos)
    args = (processor.pad_token_id, processor.image_token_id)
    with torch.no_grad():
        base = vision_sft_loss(model, *args, demos).item()
        swapped = [type(d)(d.ids, d.prompt_len, demos[(i + 1) % len(demos)].mm) for i, d in enumerate(demos)]
        assert vision_sft_loss(model, *args, swapped).item() != base  # the pixels reach the loss
        # the answer tokens alone: a loss over every token after the first differs
        whole = [type(d)(d.ids, 1, d.mm) for d in demos]
        assert vision_sft_loss(model, *args, whole).item() != base
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(8):
        opt.zero_grad()
        loss = vision_sft_loss(model, *args, demos)
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = vision_sft_loss(model, *args, demos).item()
    assert torch.isfinite(torch.tensor(after)) and after < 0.7 * base, (base, after)
