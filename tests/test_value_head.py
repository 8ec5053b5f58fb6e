"""The critic for PPO with GAE: value alignment, packing, regression toward returns, checkpoint
round trip, and short pipeline runs of ppo_critic and gspo without NaN."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as st_load

from areal_core.config.algorithm import from_preset
from areal_core.context import load_run_config
from areal_core.models import build_tiny_model
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from areal_core.train import advantages as A
from areal_core.train.algorithm import compute_loss
from areal_core.train.value_head import CRITIC_FILE, CRITIC_OPTIMIZER_FILE, Critic, ValueModel
from tests.conftest import ROOT

TINY_MODEL = SimpleNamespace(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_position_embeddings=64
)


def toy_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """4 right-padded sequences of lengths 7, 5, 6, 4: 3 prompt tokens then a response; reward 1
    when the first response token is even."""
    torch.manual_seed(0)
    lengths = [7, 5, 6, 4]
    ids = torch.randint(3, 50, (4, 7))
    attn = torch.zeros(4, 7, dtype=torch.long)
    mask = torch.zeros(4, 7)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
        mask[i, 3:n] = 1
        ids[i, n:] = 0
    ids[:, 3] = torch.tensor([4, 7, 10, 13])
    rewards = (ids[:, 3] % 2 == 0).float()
    return ids, attn, mask, rewards


def critic(lr: float = 1e-2) -> Critic:
    torch.manual_seed(1)
    return Critic(ValueModel.from_causal_lm(build_tiny_model(TINY_MODEL, 50, seed=1)), lr=lr)


def test_values_are_aligned_with_logprobs_and_zero_at_start_and_padding():
    c = critic()
    torch.nn.init.normal_(c.model.head.proj.weight)  # non-zero head
    ids, attn, _, _ = toy_batch()
    v = c.token_values(ids, attn, grad=False)
    per_pos = c.model.position_values(ids, attn)
    assert v.shape == ids.shape
    assert torch.all(v[:, 0] == 0) and torch.all(v[attn == 0] == 0)
    # values[:, t] is read from the hidden state at t − 1 (the state in which x_t is emitted)
    assert torch.allclose(v[0, 1:7], per_pos[0, :6])
    assert v[0, 1:].abs().min() > 0


def test_fresh_head_predicts_zero_so_first_advantages_are_discounted_rewards():
    c = critic()
    ids, attn, mask, rewards = toy_batch()
    v = c.token_values(ids, attn, grad=False)
    assert torch.all(v == 0)
    mc, _ = A.gae_advantages(A.terminal_rewards(rewards, mask), v, mask, 1.0, 1.0)
    assert torch.allclose(mc, rewards[:, None] * mask)  # λ = 1: Monte-Carlo returns
    adv, _ = A.gae_advantages(A.terminal_rewards(rewards, mask), v, mask, 1.0, 0.95)
    # λ = 0.95, V ≡ 0: A_t = λ^(T−1−t) · r, e.g. row 0 (response at t = 3..6)
    assert torch.allclose(adv[0, 3:7], torch.tensor([0.95**3, 0.95**2, 0.95, 1.0]))


def test_packed_and_padded_values_agree():
    c = critic()
    torch.nn.init.normal_(c.model.head.proj.weight)
    ids, attn, _, _ = toy_batch()
    padded = c.token_values(ids, attn, grad=False)
    for budget in (0, 12):
        packed = c.token_values(ids, attn, grad=False, packing=True, pad_id=0, token_budget=budget)
        assert torch.allclose(packed, padded, atol=1e-5), budget


def test_value_head_trains_toward_returns():
    """Only the value term of the PPO-critic loss (policy log-probs held constant) drives the critic:
    its squared error to the GAE returns falls by > 20×."""
    cfg = from_preset("ppo_critic", critic={"clip": 0.0}, lam=1.0)
    c = critic(lr=3e-3)
    ids, attn, mask, rewards = toy_batch()
    logp = torch.zeros_like(mask)
    gi = torch.tensor([0, 0, 1, 1])
    target = rewards[:, None] * mask  # γ = λ = 1: every token's return is the outcome reward

    def mse() -> float:
        v = c.token_values(ids, attn, grad=False)
        return (((v - target) ** 2 * mask).sum() / mask.sum()).item()

    before = mse()
    losses = []
    for _ in range(30):
        v = c.token_values(ids, attn)
        loss, m = compute_loss(cfg, logp, logp, logp, rewards, gi, mask, values=v, old_values=v.detach())
        c.zero_grad()
        loss.backward()
        c.step()
        losses.append(m["value_loss"])
    after = mse()
    assert before == pytest.approx(0.7, abs=1e-6)  # V = 0; 7 of the 10 policy tokens have return 1
    assert after < before / 20
    assert losses[-1] < losses[0] / 20
    assert m["explained_variance"] > 0.9


def test_critic_checkpoint_round_trip(tmp_path):
    store = Store(str(tmp_path / "run"))
    c = critic()
    ids, attn, mask, rewards = toy_batch()
    v = c.token_values(ids, attn)
    ((v - rewards[:, None]) ** 2 * mask).sum().backward()
    c.step()
    c.save(store, 3)
    assert store.exists(f"trainer/checkpoints/step-000003/{CRITIC_FILE}")
    d = critic()
    assert not torch.allclose(d.token_values(ids, attn, grad=False), c.token_values(ids, attn, grad=False))
    d.restore(store, 3)
    assert torch.equal(d.token_values(ids, attn, grad=False), c.token_values(ids, attn, grad=False))
    assert d.optimizer.state_dict()["state"][0]["step"] == 1
    with pytest.raises(FileNotFoundError, match="no critic"):
        d.restore(store, 4)


class _Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # code run by any unpickler that trusts the bytes


def test_a_pickle_planted_as_the_critic_optimizer_state_runs_no_code_on_resume(tmp_path):
    import pickle

    store = Store(str(tmp_path / "run"))
    c = critic()
    c.save(store, 3)
    marker = tmp_path / "pwned"
    store.write_bytes(f"trainer/checkpoints/step-000003/{CRITIC_OPTIMIZER_FILE}", pickle.dumps(_Planted(str(marker))))
    with pytest.raises(ValueError, match="is not a weights-only optimizer state; refused"):
        critic().restore(store, 3)
    assert not marker.exists()


def _run(tiny_overrides: list[str], preset: str) -> Store:
    run_uri, _ = pipeline.prepare(str(ROOT / "configs" / "algorithms" / f"{preset}.yaml"), tiny_overrides)
    pipeline.sft(run_uri)
    store = Store(run_uri)
    cfg = load_run_config(store)
    launch(store.uri, 1, 1, timeout_s=300, progress=False)
    assert store.done() and store.latest_version() == cfg.train.steps
    rows = [json.loads(line) for line in store.read_text("trainer/metrics.jsonl").splitlines() if line]
    assert [r["step"] for r in rows] == list(range(1, cfg.train.steps + 1))
    for r in rows:
        bad = {k: v for k, v in r.items() if not math.isfinite(v)}
        assert not bad, (r["step"], bad)
    return store


@pytest.mark.slow
def test_ppo_critic_pipeline_runs_without_nan_and_checkpoints_but_never_publishes_the_critic(tiny_overrides):
    store = _run([*tiny_overrides, "train.steps=6", "algo.critic.lr=1e-3"], "ppo_critic")
    rows = [json.loads(line) for line in store.read_text("trainer/metrics.jsonl").splitlines() if line]
    assert all("value_loss" in r and "explained_variance" in r and r["critic_grad_norm"] > 0 for r in rows)
    # the critic is in the checkpoint ...
    ckpt = "trainer/checkpoints/step-000006"
    saved = st_load(store.read_bytes(f"{ckpt}/{CRITIC_FILE}"))
    assert saved["head.proj.weight"].abs().sum() > 0  # the head moved away from its zero init
    # ... but weights/v{N} hold only the policy
    published = st_load(store.read_bytes("weights/v000006/model.safetensors"))
    assert not any(k.startswith(("head.", "body.")) for k in published)
    assert not any("critic" in p for p in store.find("weights"))
    # a restarted trainer gets the critic back from the checkpoint
    from areal_core.train.run_trainer import build_run_trainer

    t = build_run_trainer(store.uri, load_run_config(store))
    assert t.state.step == 6 and t.parts.critic is not None
    restored = t.parts.critic.model.state_dict()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_gspo_pipeline_runs_without_nan(tiny_overrides):
    store = _run(tiny_overrides, "gspo")
    rows = [json.loads(line) for line in store.read_text("trainer/metrics.jsonl").splitlines() if line]
    assert all(0.0 <= r["clip_frac"] <= 1.0 for r in rows)


def test_a_non_finite_critic_gradient_skips_the_critics_step():
    """A NaN in the critic's gradient never reaches its weights or AdamW's moments (as the policy's
    does not, tests/test_fsdp.py); the next finite step updates it as usual."""
    cfg = from_preset("ppo_critic", critic={"clip": 0.0}, lam=1.0)
    c = critic(lr=3e-3)
    ids, attn, mask, rewards = toy_batch()
    logp, gi = torch.zeros_like(mask), torch.tensor([0, 0, 1, 1])

    def backward() -> None:
        v = c.token_values(ids, attn)
        loss, _ = compute_loss(cfg, logp, logp, logp, rewards, gi, mask, values=v, old_values=v.detach())
        c.zero_grad()
        loss.backward()

    before = {k: t.clone() for k, t in c.model.state_dict().items()}
    poison = next(p for p in c.model.parameters() if p.requires_grad).register_hook(lambda g: g * float("nan"))
    backward()
    poison.remove()
    assert math.isnan(c.step())
    assert all(torch.equal(t, before[k]) for k, t in c.model.state_dict().items())
    assert all(not s for s in c.optimizer.state.values())  # no moments were written
    backward()
    assert math.isfinite(c.step())
    assert any(not torch.equal(t, before[k]) for k, t in c.model.state_dict().items())
