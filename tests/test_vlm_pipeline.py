"""A vision-language run through the real pipeline: the config refuses what a VLM cannot do yet
before any work; the policy never samples a vision placeholder (engine and trainer mask the same
tokens, so their log-probs still agree); a shard whose policy tokens hold one is quarantined;
and `configs/vlm_shapes.yaml`, shrunk, runs prepare → SFT → rollout/reward/trainer → evaluation
to DONE with the images stored once and named by every trained row."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from areal_core.config import ConfigError, RunConfig, load_config
from areal_core.context import load_run_config
from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.protocol import read_shard_or_quarantine, write_shard
from areal_core.run import pipeline
from areal_core.run.derived import DerivedRunError, derived_config
from areal_core.run.launcher import launch
from areal_core.run.pipeline import metrics_rows
from areal_core.store import Store
from areal_core.train.batch import collate
from areal_core.train.checkpoint import TrainerState
from areal_core.train.parts import shard_limits
from areal_core.train.sft import run_sft
from areal_core.train.sources import GradedShards
from areal_core.train.step import policy_logprobs
from areal_core.vlm.images import ImageCache, encode_png, put_image
from areal_core.vlm.inputs import MultimodalRows, PlaceholderCheck, vision_token_ids
from areal_core.vlm.model import IMAGE_PAD, VISION_TOKENS
from tests.test_vlm_model import picture, tiny
from tests.test_vlm_store import sample
from tests.test_vlm_train import rollouts


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.engine=continuous", "rollout.engine"),
        ("rollout.engine=vllm", "rollout.engine"),
        ("train.packing=true", "train.packing"),
        ("train.nproc_per_node=2", "train.nproc_per_node"),
    ],
)
def test_the_config_refuses_what_a_vlm_run_cannot_do_before_any_work(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/vlm_shapes.yaml", [f"store={tmp_path}/run", override])


@pytest.mark.parametrize("algo", ["algo.adv_estimator=gae", "algo.adv_estimator=gae algo.entropy_coef=0.01"])
def test_a_vlm_run_refuses_losses_that_need_a_critic(tmp_path, algo):
    with pytest.raises(ConfigError, match=r"model.kind vlm does not train with \['values'\]"):
        pipeline.prepare("configs/vlm_shapes.yaml", [f"store={tmp_path}/run", *algo.split()])
    assert not (tmp_path / "run").exists()  # refused before the root is claimed


def test_a_vlm_run_takes_an_entropy_bonus(tmp_path):
    overrides = [f"store={tmp_path}/run", "algo.entropy_coef=0.01", "task.num_train=8", "task.num_eval=4"]
    uri, _ = pipeline.prepare("configs/vlm_shapes.yaml", overrides)
    assert load_run_config(Store(uri)).algo.entropy_coef == 0.01


def test_a_picture_task_with_a_text_model_is_refused_before_prompts_are_written(tmp_path):
    with pytest.raises(ConfigError, match="model.kind"):
        pipeline.prepare("configs/vlm_shapes.yaml", [f"store={tmp_path}/run", "model.kind=tiny", "train.packing=false"])
    assert not list((tmp_path / "run").glob("prompts*"))


def test_the_placeholders_are_the_configs_vision_tokens():
    model, processor = tiny()
    ids = vision_token_ids(model.config)
    assert processor.image_token_id in ids
    assert set(ids) <= {processor.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    assert vision_token_ids(Qwen2Config()) == () and vision_token_ids(None) == ()  # a text model has none


def favour_image_pad(model, token: int) -> None:
    """A policy that would pick the image pad almost always: +40 on its logit at every position."""

    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., token] += 40.0
        return out

    model.get_output_embeddings().register_forward_hook(hook)


def test_the_engine_never_samples_a_placeholder_and_the_trainer_masks_the_same_tokens(tmp_path):
    model, processor = tiny()
    favour_image_pad(model, processor.image_token_id)
    _, _, store, samples = rollouts(tmp_path, policy=(model, processor))
    responses = [s.input_ids[s.prompt_len :] for s in samples]
    assert all(len(r) == 5 for r in responses) and not any(
        t in vision_token_ids(model.config) for r in responses for t in r
    )
    batch = collate(samples, processor.pad_token_id)
    rows = MultimodalRows.from_samples(samples, processor, ImageCache([store]))
    with torch.no_grad():
        logp = policy_logprobs(model, batch, None, RunConfig(), processor.pad_token_id, mm=rows)
    mask = batch.loss_mask.bool()
    assert torch.isfinite(logp).all()  # the prompt's own image pads are targets: 0, not -inf
    torch.testing.assert_close(logp[mask], batch.behav_logprobs[mask], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("where", ["response", "text row", "prompt with its image"])
def test_a_vision_placeholder_outside_an_images_prompt_quarantines_its_shard(tmp_path, where):
    model, processor = tiny()
    store = Store(str(tmp_path))
    sha = put_image(store, encode_png(picture()))
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    bad = sample(0, [sha] if where != "text row" else None)
    at = 3 if where == "response" else 0  # loss_mask [0, 0, 1, 1]
    bad.input_ids = [pad if i == at else t for i, t in enumerate(bad.input_ids)]
    rel = LAYOUT.graded_shard("rollout-0", 1)
    write_shard(store, rel, [sample(1), bad])
    got = read_shard_or_quarantine(store, rel, limits=shard_limits(model))
    if where == "prompt with its image":
        assert got is not None and len(got) == 2
        return
    assert got is None
    [note] = store.find(LAYOUT.quarantine_dir, ".reason.json")
    reason = store.read_json(note)["reason"]
    assert "vision placeholder" in reason and (("without image_ids" in reason) == (where == "text row"))


@pytest.mark.slow
def test_the_vlm_shapes_config_runs_the_pipeline_to_done(tmp_path):
    overrides = [
        f"store={tmp_path}/run",
        "sft.steps=10",
        "train.steps=4",
        "train.checkpoint_every=2",
        "task.num_train=64",
        "task.num_eval=16",
        "eval.num_samples=16",
    ]
    uri, _ = pipeline.prepare("configs/vlm_shapes.yaml", overrides)
    store = Store(uri)
    images = store.find(LAYOUT.images_dir, "")
    assert 0 < len(images) <= 80  # one picture per scene, stored once by content
    run_sft(uri)
    launch(uri, 1, 1, timeout_s=600, progress=False)
    assert store.done()
    rows = [r for r in metrics_rows(store) if "image_rows" in r]
    assert len(rows) == 4 and all(r["image_rows"] == 32 for r in rows)  # B 4 × G 8, each with its picture
    result = pipeline.evaluate_run(uri)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0


def test_a_fork_or_replay_of_a_vlm_run_refuses_the_same_losses(tmp_path):
    source = load_config("configs/vlm_shapes.yaml", [f"store={tmp_path}/run"])
    with pytest.raises(DerivedRunError, match="model.kind vlm does not train with"):
        derived_config(source, ["algo.adv_estimator=gae"], f"{tmp_path}/fork", (), "fork")
    assert derived_config(source, ["algo.entropy_coef=0.01"], f"{tmp_path}/fork", (), "fork").algo.entropy_coef == 0.01
    assert derived_config(source, ["train.lr=1e-4"], f"{tmp_path}/fork", (), "fork").train.lr == 1e-4


@pytest.mark.parametrize("damage", ["one pad short", "split run", "no image named", "intact"])
def test_a_sample_whose_image_pads_do_not_fit_its_image_quarantines_its_shard(tmp_path, damage):
    """A crafted prompt whose pads do not stand for its images would stop the trainer in
    get_rope_index; the trainer's source quarantines its shard instead (GradedShards.check)."""
    model, processor = tiny()
    _, _, store, samples = rollouts(tmp_path, policy=(model, processor))
    s = samples[0]
    pad = processor.image_token_id
    first = s.input_ids.index(pad)
    if damage == "one pad short":
        s.input_ids, s.prompt_len = s.input_ids[:first] + s.input_ids[first + 1 :], s.prompt_len - 1
        for name in ("loss_mask", "behav_logprobs", "versions"):
            setattr(s, name, getattr(s, name)[1:])
    elif damage == "split run":
        s.input_ids = [*s.input_ids[: first + 2], processor.pad_token_id, *s.input_ids[first + 3 :]]
    elif damage == "no image named":
        s.image_ids = None
    cfg = RunConfig.model_validate({"model": {"kind": "vlm"}, "train": {"packing": False}})
    source = GradedShards(store, cfg, TrainerState(), EventLog(None, "trainer", "0"), limits=shard_limits(model))
    source.check = PlaceholderCheck(processor, ImageCache([store]))
    write_shard(store, LAYOUT.graded_shard("rollout-0", 0), samples)
    source.ingest(0)
    quarantined = store.find(LAYOUT.quarantine_dir, ".reason.json")
    if damage == "intact":
        assert not quarantined and source.counters.quarantined_shards == 0
        return
    assert len(quarantined) == 1 and source.counters.quarantined_shards == 1
    reason = store.read_json(quarantined[0])["reason"]
    assert ("without image_ids" if damage == "no image named" else "do not match its images") in reason


def test_freeze_vision_trains_the_lm_only_and_is_refused_for_a_text_model(tmp_path):
    from areal_core.train.parts import make_optimizer
    from areal_core.vlm.model import freeze_vision_tower, save_vlm

    model, processor = tiny()
    save_vlm(model, processor, tmp_path / "vlm")
    cfg = load_config("configs/vlm_shapes.yaml", [f"store={tmp_path}/run", "train.freeze_vision=true"])
    visual = {id(p) for p in model.model.visual.parameters()}
    frozen = freeze_vision_tower(model)
    assert frozen == sum(p.numel() for p in model.model.visual.parameters()) > 0
    trained = [p for g in make_optimizer(model, cfg, False).param_groups for p in g["params"]]
    assert trained and not {id(p) for p in trained} & visual  # no optimizer state for the tower
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("model.visual"))
    with pytest.raises(ConfigError, match=r"train\.freeze_vision"):
        load_config(None, ["train.freeze_vision=true"])
    with pytest.raises(ValueError, match="no vision tower"):
        freeze_vision_tower(torch.nn.Linear(2, 2))
