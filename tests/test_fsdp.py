"""The one training step (`areal_core/train/step.py`): one process vs two FSDP2 ranks (gloo) on
the same fixed batches.

`train_step` splits each batch's groups across ranks and rescales every rank's loss, so the
reduced gradient is the full batch's; the loss curve and the parameters after every step must
match the single-process run (world size 1, no process group) up to float reassociation.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from areal_core.config import load_config
from areal_core.models import build_tiny_model
from areal_core.protocol import Sample
from tests.conftest import free_port

VOCAB = 300
MODEL = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    f"model.vocab_size={VOCAB}",
]
# (groups, group size) per step: three groups split 2/1 across two ranks
STEPS = [(4, 4), (3, 3), (4, 4), (2, 4)]


# algorithm overrides: the default (GRPO, decoupled PPO, token-mean); Dr.GRPO (a constant
# normaliser that falls back to the longest response of the minibatch); GSPO (sequence-level
# ratio, sequence-mean aggregation)
ALGOS = {
    "grpo": [],
    "dr_grpo": ["algo.adv_estimator=dr_grpo", "algo.aggregation=seq_mean_token_sum_norm"],
    "gspo": ["algo.loss=gspo", "algo.aggregation=seq_mean_token_mean", "algo.behav_level=geometric"],
    # micro-batches of ≤ 24 tokens (groups of ~40 split into runs of rows): ranks run different counts
    "grpo_micro": ["train.max_tokens_per_micro_batch=24"],
}


def run_config(minibatches: int = 1, algo: str = "grpo"):
    return load_config(
        None,
        [*MODEL, f"train.ppo_minibatches={minibatches}", "train.batch_groups=2", "train.lr=3e-3", *ALGOS[algo]],
    )


def varying_reward(rng: random.Random, step: int, g: int, k: int) -> float:
    return float(rng.random() < 0.5 if k else 1.0 - (g % 2))


def fixed_batches(seed: int = 0, steps=STEPS, reward=varying_reward) -> list[list[Sample]]:
    """Deterministic groups: random prompts and responses, rewards from `reward(rng, step, group, k)`
    (by default varying inside groups), and behaviour log-probs near (not equal to) the policy's so
    that the importance weights matter. `steps`: (groups, group size) per step."""
    rng = random.Random(seed)
    out = []
    for step, (groups, size) in enumerate(steps):
        samples = []
        for g in range(groups):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
            for k in range(size):
                resp = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))]
                n_p, n_r = len(prompt), len(resp)
                samples.append(
                    Sample(
                        sample_id=f"s{step}-{g}-{k}",
                        group_id=f"s{step}-{g}",
                        prompt_id=f"p{g}",
                        worker_id="w",
                        input_ids=prompt + resp,
                        prompt_len=n_p,
                        loss_mask=[0] * n_p + [1] * n_r,
                        behav_logprobs=[0.0] * n_p + [-5.7 + rng.uniform(-0.3, 0.3) for _ in range(n_r)],
                        versions=[-1] * n_p + [0] * n_r,
                        reward=reward(rng, step, g, k),
                    )
                )
        out.append(samples)
    return out


def make_model(cfg):
    model = build_tiny_model(cfg.model, VOCAB, seed=cfg.seed)
    model.train()
    return model


def make_optimizer(model, cfg):
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0, betas=(0.9, 0.99))


def train_curve(cfg, ctx=None, data=None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Per-step metrics and the final state of a run over `data` (default: `fixed_batches()`)."""
    from areal_core.train.distributed import full_state_dict, shard_model
    from areal_core.train.step import train_step

    model = make_model(cfg)
    if ctx is not None:
        model = shard_model(model, ctx)
    opt = make_optimizer(model, cfg)
    stats = [train_step(model, opt, samples, cfg, 0, ctx=ctx) for samples in data or fixed_batches()]
    return stats, full_state_dict(model, ctx) if ctx is not None else dict(model.state_dict())


@pytest.mark.parametrize("minibatches,algo", [(1, "grpo"), (2, "grpo"), (2, "dr_grpo")])
def test_world_size_one_needs_no_process_group(minibatches, algo):
    """The ordinary case: no process group, collectives are identities; a world-size-1 context
    gives exactly the step without one, and it trains."""
    from areal_core.train.distributed import DistContext

    torch.set_num_threads(1)
    cfg = run_config(minibatches, algo)
    ref_stats, ref_sd = train_curve(cfg)
    got_stats, got_sd = train_curve(cfg, DistContext(world_size=1))
    assert not torch.distributed.is_initialized()
    for ref, got in zip(ref_stats, got_stats):
        for key in ("loss", "grad_norm", "clip_frac", "reward_mean", "response_tokens"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    for name, tensor in ref_sd.items():
        torch.testing.assert_close(got_sd[name], tensor, rtol=1e-5, atol=1e-6)
    assert ref_stats[0]["loss"] != ref_stats[-1]["loss"]  # it does train


def test_groups_are_split_contiguously_and_a_rank_may_get_none():
    from areal_core.train.minibatches import rank_groups

    groups = torch.arange(5)
    assert [rank_groups(groups, r, 2).tolist() for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert rank_groups(torch.arange(1), 1, 2).tolist() == []


CASES = [(1, "grpo"), (2, "dr_grpo"), (2, "gspo"), (2, "grpo_micro")]  # (minibatches, algorithm)
# zero-advantage rows skipped on two ranks (tests/test_zero_advantage.py's batches: groups of equal rewards,
# a minibatch where both ranks are left with nothing) against one process that trains every row
SKIP_CASES = [(2, "grpo"), (2, "dr_grpo"), (2, "grpo_micro")]


def uniform_batches():
    from tests.test_zero_advantage import batches

    return batches()


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    from areal_core.train.distributed import init_distributed, shard_model, shutdown, state_dict_bytes_rank0

    ctx = init_distributed("cpu", timeout_s=120)
    assert ctx.backend == "gloo" and ctx.world_size == world
    for minibatches, algo in CASES:
        stats, sd = train_curve(run_config(minibatches, algo), ctx)
        if rank == 0:
            torch.save(sd, os.path.join(out_dir, f"state-{minibatches}-{algo}.pt"))
            with open(os.path.join(out_dir, f"stats-{minibatches}-{algo}.json"), "w") as f:
                json.dump(stats, f)
    for minibatches, algo in SKIP_CASES:
        stats, sd = train_curve(run_config(minibatches, algo), ctx, uniform_batches())
        if rank == 0:
            torch.save(sd, os.path.join(out_dir, f"skip-state-{minibatches}-{algo}.pt"))
            with open(os.path.join(out_dir, f"skip-stats-{minibatches}-{algo}.json"), "w") as f:
                json.dump(stats, f)
    model = shard_model(make_model(run_config()), ctx)
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    blob = state_dict_bytes_rank0(model, ctx)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"local": local, "total": total, "blob": blob is not None}, f)
    shutdown(ctx)


@pytest.mark.slow
def test_two_process_fsdp2_matches_one_process(tmp_path):
    """Loss curve, grad norms, clip fractions and final parameters of a two-rank FSDP2 run (gloo)
    equal the single-process run for GRPO, Dr.GRPO with two minibatches and GSPO with two
    minibatches. Groups split 2/1 across the ranks, and one-group minibatches leave a rank
    with only a masked dummy row."""
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for minibatches, algo in CASES:
        ref_stats, ref_sd = train_curve(run_config(minibatches, algo))
        got_stats = json.loads((tmp_path / f"stats-{minibatches}-{algo}.json").read_text())
        ref_curve = [s["loss"] for s in ref_stats]
        got_curve = [s["loss"] for s in got_stats]
        assert got_curve == pytest.approx(ref_curve, rel=1e-4, abs=1e-6), algo
        for ref, got in zip(ref_stats, got_stats):
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), algo
            assert got["clip_frac"] == pytest.approx(ref["clip_frac"], abs=1e-6), algo
            assert got["response_tokens"] == ref["response_tokens"]
        got_sd = torch.load(tmp_path / f"state-{minibatches}-{algo}.pt")
        assert set(got_sd) == set(ref_sd)
        for name, tensor in ref_sd.items():
            torch.testing.assert_close(got_sd[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{algo} {name}")
    for minibatches, algo in SKIP_CASES:
        skipping, _ = train_curve(run_config(minibatches, algo), data=uniform_batches())
        full_cfg = run_config(minibatches, algo).model_copy(deep=True)
        full_cfg.train.skip_zero_advantage = False
        ref_stats, ref_sd = train_curve(full_cfg, data=uniform_batches())
        got_stats = json.loads((tmp_path / f"skip-stats-{minibatches}-{algo}.json").read_text())
        assert [s["zero_adv_rows_skipped"] for s in got_stats] == [4.0, 6.0, 12.0, 0.0], algo
        for ref, one, got in zip(ref_stats, skipping, got_stats):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6), algo
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4, abs=1e-6), algo
            # the metrics of the passes: over the rows trained on, each rank weighted by its share of them
            for key in ("clip_frac", "importance_weight_mean"):
                assert got[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (algo, key)
            assert got["policy_tokens"] == one["policy_tokens"], algo
            if got["zero_adv_rows_skipped"]:
                assert got["policy_tokens"] < ref["policy_tokens"], algo
        got_sd = torch.load(tmp_path / f"skip-state-{minibatches}-{algo}.pt")
        for name, tensor in ref_sd.items():
            torch.testing.assert_close(got_sd[name], tensor, rtol=1e-4, atol=2e-5, msg=f"skip {algo} {name}")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["total"] == ranks[1]["total"]
    assert all(r["local"] < r["total"] for r in ranks)  # parameters really are sharded
    assert [r["blob"] for r in ranks] == [True, False]  # only rank 0 gets the weights to publish


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted():
    """A NaN in the gradient never reaches the weights or AdamW's moments: the update is skipped,
    `nonfinite_grad_frac` says so, and the next step trains as from the unharmed state."""
    from areal_core.train.step import train_step

    cfg = run_config()
    batches = fixed_batches()
    model, twin = make_model(cfg), make_model(cfg)
    opt, twin_opt = make_optimizer(model, cfg), make_optimizer(twin, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    poison = next(model.parameters()).register_hook(lambda g: g * float("nan"))
    stats = train_step(model, opt, batches[0], cfg, 0)
    poison.remove()
    assert stats["nonfinite_grad_frac"] == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(not s for s in opt.state.values())  # no moments were written
    healthy = train_step(model, opt, batches[1], cfg, 0)
    reference = train_step(twin, twin_opt, batches[1], cfg, 0)
    assert healthy["nonfinite_grad_frac"] == 0.0 and healthy["loss"] == pytest.approx(reference["loss"])
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.isfinite(v).all() and torch.allclose(v, w, atol=1e-6), k
