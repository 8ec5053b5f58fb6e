"""Every registered loss gives the values, gradients and metrics it gave before the `(cfg, LossInputs)`
refactor of issue 47.

tests/data/loss_reference.json holds the inputs (small float32 tensors) and, per case, the loss,
its gradient with respect to log π_θ (and the critic's values) and the metrics, as the loss code
of commit 8ac0641 computed them (`python tests/test_loss_reference.py --write` wrote the file with
that code; rerunning it rewrites the reference with whatever code is checked out, so do not,
unless a change of numerics is intended and said so in the commit). Metrics added since
(clip_frac_adv_pos/neg, sampled_entropy) were appended to it with every value and gradient of
that code checked unchanged first.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.algorithm import total_loss
from areal_core.train.loss.registry import LossInputs, get_loss, known_losses

REFERENCE = Path(__file__).resolve().parent / "data" / "loss_reference.json"
N, T = 4, 6

# (case name, loss name, config overrides, LossInputs overrides: "global" adds global denominators)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("decoupled_default", "decoupled_ppo", {}, {}),
    ("decoupled_uncapped", "decoupled_ppo", {"behav_high": 0.0, "eps_high": 0.2}, {}),
    ("decoupled_mask5", "decoupled_ppo", {"behav_correction": "mask", "behav_high": 5.0, "eps_high": 0.2}, {}),
    ("decoupled_icepop", "decoupled_ppo", {"behav_correction": "mask", "behav_low": 0.5, "behav_high": 2.0}, {}),
    ("decoupled_none", "decoupled_ppo", {"behav_correction": "none"}, {}),
    ("decoupled_dual", "decoupled_ppo", {"dual_clip": 3.0, "eps_low": 0.1}, {}),
    ("decoupled_seqmean", "decoupled_ppo", {"aggregation": "seq_mean_token_mean"}, {}),
    ("decoupled_drgrpo", "decoupled_ppo", {"aggregation": "seq_mean_token_sum_norm", "norm_const": 8.0}, {}),
    ("decoupled_drgrpo0", "decoupled_ppo", {"aggregation": "seq_mean_token_sum_norm"}, {}),
    ("decoupled_seq_level", "decoupled_ppo", {"behav_level": "sequence", "behav_high": 3.0}, {}),
    ("decoupled_geo_mask", "decoupled_ppo", {"behav_level": "geometric", "behav_correction": "mask"}, {}),
    ("decoupled_global", "decoupled_ppo", {}, {"global": True}),
    ("ppo", "ppo", {}, {}),
    ("ppo_dual", "ppo", {"dual_clip": 2.0, "aggregation": "seq_mean_token_mean"}, {}),
    ("gspo", "gspo", {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}, {}),
    ("gspo_geo", "gspo", {"behav_level": "geometric", "eps_low": 0.05, "eps_high": 0.05}, {}),
    ("gspo_token", "gspo_token", {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}, {}),
    ("cispo", "cispo", {"eps_low": 0.99}, {}),
    ("cispo_mask", "cispo", {"behav_correction": "mask", "behav_low": 0.5, "behav_high": 2.0}, {"global": True}),
    ("sapo", "sapo", {"behav_correction": "none"}, {}),
    ("sapo_trunc", "sapo", {"sapo": {"tau_pos": 2.0, "tau_neg": 3.0}, "aggregation": "seq_mean_token_mean"}, {}),
    ("distill", "distill", {}, {}),
    ("distill_only", "distill", {"distill": {"coef": 1.0, "rl_coef": 0.0}, "behav_correction": "mask"}, {}),
    ("m2po", "m2po", {"m2po": {"threshold": 0.04}}, {}),
    ("m2po_mask", "m2po", {"m2po": {"threshold": 0.2}, "behav_correction": "mask", "dual_clip": 3.0}, {}),
    ("kpop", "kpop", {"kpop": {"threshold": 0.05}}, {}),
    ("kpop_seq", "kpop", {"kpop": {"threshold": 0.02}, "aggregation": "seq_mean_token_mean"}, {"global": True}),
    ("dpo", "dpo", {"dpo": {"beta": 0.2, "label_smoothing": 0.1}}, {}),
    ("ipo", "ipo", {"ipo": {"beta": 0.5}}, {}),
    # through total_loss: the critic term (gae), the KL term and the entropy bonus
    ("total_gae", "total", {"adv_estimator": "gae", "lam": 0.9, "critic": {"clip": 0.2}, "kl_coef": 0.05}, {}),
    ("total_entropy", "total", {"entropy_coef": 0.01, "kl_coef": 0.1, "kl_estimator": "k2"}, {}),
]


def make_inputs(seed: int = 47) -> dict[str, list]:
    """The shared random inputs: some w = π_prox/π_behav far above 5 and below 0.2, one impossible
    behaviour token (−inf), padding and an interior gap in the mask, two groups of two."""
    g = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(N, T, generator=g) * 3 + 0.05)
    prox = logp + 0.3 * torch.randn(N, T, generator=g)
    behav = prox + 0.9 * torch.randn(N, T, generator=g)
    behav[1, 2] = -math.inf
    behav[0, 1], behav[2, 0], behav[3, 4] = prox[0, 1] - 2.5, prox[2, 0] - 1.8, prox[3, 4] - 1.7  # w = 12, 6, 5.5
    prox = prox.clamp(max=-1e-3)
    behav = torch.where(torch.isfinite(behav), behav.clamp(max=-1e-3), behav)
    mask = torch.ones(N, T)
    mask[0, 5] = mask[2, 4:] = 0
    mask[3, 1] = 0
    return {
        "logp": logp.tolist(),
        "prox_logp": prox.tolist(),
        "behav_logp": [[x if math.isfinite(x) else "-inf" for x in row] for row in behav.tolist()],
        "mask": mask.tolist(),
        "rewards": [1.0, 0.0, 0.0, 1.0],
        "group_index": [0, 0, 1, 1],
        "advantages": torch.randn(N, T, generator=g).mul(mask).tolist(),
        "ref_logp": (logp + 0.2 * torch.randn(N, T, generator=g)).tolist(),
        "teacher_logp": (logp + 0.5 * torch.randn(N, T, generator=g)).tolist(),
        "values": torch.randn(N, T, generator=g).tolist(),
        "old_values": torch.randn(N, T, generator=g).tolist(),
        "returns": torch.randn(N, T, generator=g).tolist(),
        "entropy": torch.rand(N, T, generator=g).tolist(),
    }


def _tensor(rows: list) -> torch.Tensor:
    return torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float32)


def run_case(data: dict[str, list], loss: str, overrides: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """(loss, d loss / d logp, d loss / d values, metrics) of one case on `data`."""
    logp = _tensor(data["logp"]).requires_grad_(True)
    values = _tensor(data["values"]).requires_grad_(True)
    mask = _tensor(data["mask"])
    x = LossInputs(
        logp=logp,
        prox_logp=_tensor(data["prox_logp"]),
        behav_logp=_tensor(data["behav_logp"]),
        mask=mask,
        rewards=torch.tensor(data["rewards"]),
        group_index=torch.tensor(data["group_index"]),
        advantages=None if loss == "total" else _tensor(data["advantages"]),
        ref_logp=_tensor(data["ref_logp"]),
        teacher_logp=_tensor(data["teacher_logp"]),
        values=values,
        old_values=_tensor(data["old_values"]),
        returns=_tensor(data["returns"]),
        entropy=_tensor(data["entropy"]) if loss == "total" else None,
        global_tokens=float(mask.sum()) + 3.0 if extra.get("global") else None,
        global_seqs=float(N) + 1.0 if extra.get("global") else None,
    )
    cfg = AlgorithmConfig(**({"loss": loss} if loss != "total" else {}), **overrides)
    value, metrics = total_loss(cfg, x) if loss == "total" else get_loss(loss)(cfg, x)
    value.backward()
    zero = torch.zeros(N, T)
    return {
        "loss": value.item(),
        "grad_logp": (logp.grad if logp.grad is not None else zero).tolist(),
        "grad_values": (values.grad if values.grad is not None else zero).tolist(),
        "metrics": {k: float(v) for k, v in sorted(metrics.items())},
    }


def write_reference() -> None:
    data = make_inputs()
    cases = {name: run_case(data, loss, cfg, extra) for name, loss, cfg, extra in CASES}
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps({"inputs": data, "cases": cases}, indent=1) + "\n")


def _close(a: float, b: float, tol: float = 1e-6) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


def test_every_registered_policy_loss_has_a_reference_case():
    assert {loss for _, loss, _, _ in CASES} - {"total"} == set(known_losses())


@pytest.mark.parametrize("name,loss,overrides,extra", CASES, ids=[c[0] for c in CASES])
def test_loss_value_gradient_and_metrics_match_the_reference(reference, name, loss, overrides, extra):
    want = reference["cases"][name]
    got = run_case(reference["inputs"], loss, overrides, extra)
    assert _close(got["loss"], want["loss"]), (got["loss"], want["loss"])
    for key in ("grad_logp", "grad_values"):
        g, w = torch.tensor(got[key]), torch.tensor(want[key])
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-7), f"{key}: max diff {(g - w).abs().max().item()}"
    assert set(got["metrics"]) == set(want["metrics"])
    bad = {k: (got["metrics"][k], v) for k, v in want["metrics"].items() if not _close(got["metrics"][k], v)}
    assert not bad, bad


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_reference()
