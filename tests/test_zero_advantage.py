"""`train.skip_zero_advantage` (areal_core/train/zero_advantage.py): rows whose advantages are all zero are
left out of the policy passes only where that leaves the step unchanged. Each test trains two copies of one
tiny policy side by side, skipping and not, over batches with groups of equal rewards, and holds the loss,
the gradient norm and the parameters after every step equal; and checks the rows really were skipped."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from areal_core.config import load_config
from areal_core.protocol import Sample
from areal_core.train.step import train_step
from areal_core.train.zero_advantage import inert_rows, skip_refusal, trained_rows
from tests.test_fsdp import MODEL, fixed_batches, make_model, make_optimizer

# (groups, group size, which groups have equal rewards) per step
STEPS = [(4, 4, {1}), (3, 3, {0, 2}), (4, 4, {0, 1, 3}), (2, 4, set())]


def batches(uniform_steps=STEPS, seed: int = 3) -> list[list[Sample]]:
    """tests/test_fsdp.py's random groups; the groups named in a step's set get one reward for all their samples
    (alternately 1 and 0), the others rewards that differ inside the group."""

    def reward(rng: random.Random, step: int, g: int, k: int) -> float:
        if g in uniform_steps[step][2]:
            return float(g % 2)
        return 1.0 if k == 0 else 0.0 if k == 1 else float(rng.random() < 0.5)  # never all equal

    return fixed_batches(seed, [(groups, size) for groups, size, _ in uniform_steps], reward)


def config(*overrides: str, minibatches: int = 1):
    return load_config(
        None, [*MODEL, f"train.ppo_minibatches={minibatches}", "train.batch_groups=2", "train.lr=3e-3", *overrides]
    )


def side_by_side(overrides: list[str], minibatches: int = 1, steps=STEPS, ref: bool = False):
    """Both copies' per-step metrics and the largest parameter gap after each step."""
    torch.set_num_threads(1)
    on, off = (
        config(*overrides, minibatches=minibatches),
        config(*overrides, "train.skip_zero_advantage=false", minibatches=minibatches),
    )
    a = make_model(on)
    b = copy.deepcopy(a)
    ref_model = copy.deepcopy(a).eval() if ref else None
    opt_a, opt_b = make_optimizer(a, on), make_optimizer(b, off)
    out = []
    for samples in batches(steps):
        m_a = train_step(a, opt_a, samples, on, 0, ref_model=ref_model)
        m_b = train_step(b, opt_b, samples, off, 0, ref_model=ref_model)
        gap = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
        out.append((m_a, m_b, gap))
    return out


LOSSES = {
    "decoupled_ppo": [],
    "ppo": ["algo.loss=ppo"],
    "gspo": ["algo.loss=gspo", "algo.aggregation=seq_mean_token_mean", "algo.behav_level=geometric"],
    "gspo_token": ["algo.loss=gspo_token", "algo.aggregation=seq_mean_token_mean"],
    "cispo": ["algo.loss=cispo"],
    "sapo": ["algo.loss=sapo"],
    "kpop": ["algo.loss=kpop"],
    "dr_grpo": ["algo.adv_estimator=dr_grpo", "algo.aggregation=seq_mean_token_sum_norm"],
    "rloo_seq_mean": ["algo.adv_estimator=rloo", "algo.aggregation=seq_mean_token_mean"],
    "micro_batches": ["train.max_tokens_per_micro_batch=24"],
    "dual_clip_mask": ["algo.dual_clip=3.0", "algo.behav_correction=mask", "algo.behav_high=5.0"],
}


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_skipping_zero_advantage_rows_leaves_every_step_unchanged(name, minibatches):
    """Loss, gradient norm and parameters equal (float32 reassociation only) after every step, while the
    skipping copy trained on fewer rows. Fails if the skipped rows left the denominators (token or sequence
    counts, Dr.GRPO's constant) or if a step with nothing left to train skipped AdamW's update."""
    rows = side_by_side(LOSSES[name], minibatches)
    skipped = [m_a["zero_adv_rows_skipped"] for m_a, _, _ in rows]
    assert skipped == [4.0, 6.0, 12.0, 0.0]  # the uniform groups' rows, every one of them
    for m_a, m_b, gap in rows:
        assert m_b["zero_adv_rows_skipped"] == 0.0
        assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-5, abs=1e-7)
        assert m_a["grad_norm"] == pytest.approx(m_b["grad_norm"], rel=1e-5, abs=1e-7)
        assert m_a["response_tokens"] == m_b["response_tokens"]  # the whole batch's, not the trained rows'
        assert gap < 1e-5, gap  # lr 3e-3: a wrong denominator or a skipped AdamW update moves ~lr
        for m in (m_a, m_b):  # the policy loss is the whole loss here, summed over micro-batches like it
            assert m["loss_policy"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-7)
    trained = [m_a["policy_tokens"] < m_b["policy_tokens"] for m_a, m_b, _ in rows[:3]]
    assert all(trained)  # fewer tokens went through the passes
    assert rows[0][2] > 0 or rows[-1][0]["loss"] != rows[0][0]["loss"]  # it does train


def test_a_minibatch_with_nothing_left_still_moves_adam_like_the_full_pass():
    """Step 2's second minibatch holds only uniform groups: the skipping copy runs one masked row so every
    parameter gets a zero gradient and AdamW's momentum moves it, as the unskipped pass does. Without that
    pass the parameters would stay put and differ from the other copy's by the momentum step (~lr)."""
    steps = [(2, 4, set()), (2, 4, {0, 1}), (2, 4, {1})]
    rows = side_by_side([], minibatches=1, steps=steps)
    assert [m_a["zero_adv_rows_skipped"] for m_a, _, _ in rows] == [0.0, 8.0, 4.0]
    assert all(gap < 1e-5 for _, _, gap in rows), [gap for _, _, gap in rows]
    assert rows[1][0]["loss"] == 0.0 and rows[1][0]["grad_norm"] == 0.0


@pytest.mark.parametrize(
    "overrides,ref,why",
    [
        (["algo.kl_coef=0.1"], True, "algo.kl_coef adds a KL term"),
        (["algo.entropy_coef=0.01"], False, "algo.entropy_coef adds an entropy bonus"),
    ],
)
def test_rows_are_trained_where_a_zero_advantage_row_still_moves_the_policy(overrides, ref, why):
    """A KL term towards π_ref or an entropy bonus gives zero-advantage rows a gradient: nothing skipped,
    and both copies are the same run."""
    cfg = config(*overrides)
    assert why in skip_refusal(cfg.algo, critic=False)
    rows = side_by_side(overrides, ref=ref)
    for m_a, m_b, gap in rows:
        assert m_a["zero_adv_rows_skipped"] == 0.0
        assert m_a["loss"] == m_b["loss"] and gap == 0.0


def test_kl_folded_into_the_reward_may_skip_but_finds_no_zero_rows():
    """kl_as_reward puts the KL into the advantages: skipping is allowed. At the first step π = π_ref, the KL
    is 0 and the uniform groups are skipped; once the policy moved no row has all-zero advantages, so none
    is (the row test is exact, not |A| < ε), and the two copies stay equal."""
    overrides = ["algo.kl_coef=0.1", "algo.kl_as_reward=true"]
    assert skip_refusal(config(*overrides).algo, critic=False) == ""
    rows = side_by_side(overrides, ref=True)
    assert [m_a["zero_adv_rows_skipped"] for m_a, _, _ in rows] == [4.0, 0.0, 0.0, 0.0]
    assert all(gap < 1e-5 for _, _, gap in rows)


@pytest.mark.parametrize(
    "overrides,critic,why",
    [
        ([], True, "a critic"),
        (["algo.loss=m2po"], False, "'m2po' is not advantage-weighted"),
        (["algo.loss=distill", "algo.distill.teacher_path=/nonexistent"], False, "'distill' is not"),
        (["algo.loss=dpo"], False, "'dpo' is not"),
    ],
)
def test_the_refusal_names_what_needs_every_row(overrides, critic, why):
    assert why in skip_refusal(config(*overrides).algo, critic=critic)


def test_default_policy_losses_allow_skipping():
    for loss in ("decoupled_ppo", "ppo", "gspo", "gspo_token", "cispo", "sapo", "kpop"):
        assert skip_refusal(config(f"algo.loss={loss}").algo, critic=False) == "", loss


def test_inert_rows_are_exactly_zero_on_every_policy_token():
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1e-12, 0.0], [float("nan"), 0.0, 0.0], [5.0, 5.0, 0.0], [0.0, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0]])
    # row 0: zero; row 1: a tiny advantage is trained; row 2: NaN is trained (the step's guards see it);
    # row 3: nonzero only off the mask; row 4: no policy token at all
    assert inert_rows(adv, mask).tolist() == [True, False, False, True, True]
    rows = torch.arange(5)
    kept, none_left = trained_rows(rows, inert_rows(adv, mask))
    assert kept.tolist() == [1, 2] and not none_left
    kept, none_left = trained_rows(torch.tensor([0, 3, 4]), inert_rows(adv, mask))
    assert kept.tolist() == [0] and none_left  # one row, to run with its mask zeroed
    kept, none_left = trained_rows(rows, None)
    assert kept.tolist() == rows.tolist() and not none_left
    # rows that reach parameters the others do not (a VLM's image rows): one of them stays when all are inert
    reach = torch.tensor([False, False, False, True, True])
    kept, none_left = trained_rows(rows, inert_rows(adv, mask), reach)
    assert kept.tolist() == [1, 2, 3] and not none_left  # row 3 is inert: its loss and gradient are 0
    kept, none_left = trained_rows(torch.tensor([0, 3, 4]), inert_rows(adv, mask), reach)
    assert kept.tolist() == [3] and none_left  # the masked row is one that reaches them
    kept, none_left = trained_rows(torch.tensor([1, 2, 4]), inert_rows(adv, mask), torch.tensor([0, 1, 0, 0, 1]) > 0)
    assert kept.tolist() == [1, 2] and not none_left  # a kept row reaches them already


PASS_MEANS = ("ratio_mean", "importance_weight_mean", "importance_weight_min", "kl_behav_prox", "sampled_entropy")


def test_a_minibatch_whose_rows_were_all_skipped_does_not_dilute_the_means_over_the_passes(monkeypatch):
    """Two minibatches, the first all uniform groups: the skipping copy trains nothing there. Its means over the
    rows' passes (ratio, importance weights, entropy, ...) are the second minibatch's as the unskipped copy
    computed them, not halved by a masked row's zeros (ratio_mean was 0.5); the loss and update still average
    both; a step that trained no row reports the figures of the inert rows it ran."""
    import areal_core.train.step as step_module

    per_minibatch = []
    update = step_module.minibatch_update
    monkeypatch.setattr(
        step_module, "minibatch_update", lambda *a, **k: per_minibatch.append(update(*a, **k)) or per_minibatch[-1]
    )
    steps = [(2, 4, {0}), (2, 4, {0, 1})]
    (on1, off1, gap1), (on2, off2, gap2) = side_by_side([], minibatches=2, steps=steps)
    assert on1["zero_adv_rows_skipped"] == 4.0 and gap1 < 1e-5 and gap2 < 1e-5
    second_unskipped = per_minibatch[3]  # step 1: the skipping copy's two minibatches, then the other copy's
    assert on1["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    for key in PASS_MEANS:
        assert on1[key] == pytest.approx(second_unskipped[key], rel=1e-4, abs=1e-6), key
    assert on1["loss"] == pytest.approx(off1["loss"], rel=1e-5, abs=1e-7)
    assert on2["zero_adv_rows_skipped"] == 8.0 and on2["loss"] == 0.0 and on2["grad_norm"] == 0.0
    # nothing trained: the means are the inert rows' that ran for AdamW's sake, each its own figures (not a masked
    # row's zeros: ratio_mean 0, importance weights 0, entropy 0)
    assert set(PASS_MEANS) <= set(on2) and on2["ratio_mean"] == pytest.approx(1.0, abs=0.05)
    assert on2["importance_weight_mean"] > 0.5 and on2["sampled_entropy"] > 0.5 * off2["sampled_entropy"]


def test_a_vlm_s_vision_tower_moves_as_without_the_skip_when_its_image_rows_are_skipped(tmp_path):
    """A tiny Qwen2.5-VL, one image group and one text-only group a step; from step 1 the image group's rewards
    are equal. The vision tower is reached only by image rows: had they all been left out, its parameters would
    get no gradient and AdamW would leave them as they were (a gap of ~lr against the unskipped copy)."""
    from areal_core.store import Store
    from areal_core.vlm.images import ImageCache, put_images
    from areal_core.vlm.inputs import MultimodalRows, vision_token_ids
    from task_data.clevr import generate, record_images
    from tests.test_vlm_model import tiny

    torch.set_num_threads(1)
    model, processor = tiny()
    store = Store(str(tmp_path / "images"))
    record = generate(5, 1, 1, "count_colour")[0][0]
    image_ids = put_images(store, record_images(record))
    img_prompt, _ = processor.encode(record["prompt"], ImageCache([store]).load(image_ids))
    txt_prompt, _ = processor.encode("is there a circle?", [])
    banned = set(vision_token_ids(model.config))
    rng = random.Random(0)
    tokens = [t for t in range(3, 300) if t not in banned]

    def batch(step: int, image_uniform: bool) -> list[Sample]:
        out = []
        for g, (prompt, ids) in enumerate([(img_prompt, image_ids), (txt_prompt, None)]):
            for k in range(4):
                resp = [rng.choice(tokens) for _ in range(rng.randint(2, 5))]
                out.append(
                    Sample(
                        sample_id=f"s{step}{g}{k}",
                        group_id=f"g{step}{g}",
                        prompt_id=f"p{g}",
                        worker_id="w",
                        input_ids=prompt + resp,
                        prompt_len=len(prompt),
                        loss_mask=[0] * len(prompt) + [1] * len(resp),
                        behav_logprobs=[0.0] * len(prompt) + [-5.0] * len(resp),
                        versions=[-1] * len(prompt) + [0] * len(resp),
                        reward=1.0 if (g == 0 and image_uniform) else float(k % 2),
                        image_ids=ids,
                    )
                )
        return out

    data = [batch(0, False), batch(1, True), batch(2, True)]
    copies = {True: model, False: copy.deepcopy(model)}
    skipped = []
    for skip, m in copies.items():
        cfg = load_config(None, ["train.packing=false", f"train.skip_zero_advantage={str(skip).lower()}"])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        for samples in data:
            mm = MultimodalRows.from_samples(samples, processor, ImageCache([store]))
            out = train_step(m, opt, samples, cfg, processor.pad_token_id, mm=mm)
            skipped.append(out["zero_adv_rows_skipped"])
    assert skipped == [0.0, 4.0, 4.0, 0.0, 0.0, 0.0]
    gaps = {"visual": 0.0, "language": 0.0}
    for (name, p), q in zip(copies[True].named_parameters(), copies[False].parameters()):
        key = "visual" if ".visual." in f".{name}" else "language"
        gaps[key] = max(gaps[key], float((p - q).detach().abs().max()))
    assert gaps["visual"] < 1e-6 and gaps["language"] < 1e-5, gaps
