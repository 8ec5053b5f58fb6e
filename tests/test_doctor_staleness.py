"""The doctor says when staleness hurts the update, from the decoupled losses' metrics (issue 47)."""

from __future__ import annotations

from areal_core.report.doctor import diagnose


def rows(n: int = 30, **late: float) -> list[dict]:
    """Metrics rows of a healthy decoupled run; `late` overrides the last 5 steps' metrics."""
    base = {
        "kl_behav_prox": 2e-3,
        "behav_masked_frac": 0.01,
        "behav_nonfinite_frac": 0.0,
        "behav_truncated_frac": 0.0,
        "staleness_mean": 3.6,
    }
    return [{"step": s, **base, **(late if s > n - 5 else {})} for s in range(1, n + 1)]


def staleness_findings(metrics: list[dict]) -> list:
    return [f for f in diagnose([], metrics) if f.title == "staleness is hurting the update"]


def test_a_healthy_run_has_no_staleness_finding():
    assert staleness_findings(rows()) == []
    assert [f.kind for f in diagnose([], rows())] == ["info"]


def test_masked_tokens_above_5_percent_name_eta_and_the_learning_rate():
    (f,) = staleness_findings(rows(behav_masked_frac=0.12))
    assert f.kind == "health" and f.role == "trainer"
    assert "masked 12.0%" in f.evidence and "3.6 versions behind" in f.evidence
    assert "train.eta" in f.advice and "train.lr" in f.advice


def test_truncated_tokens_and_kl_each_raise_it_and_non_finite_tokens_do_not():
    assert staleness_findings(rows(behav_truncated_frac=0.08))
    (f,) = staleness_findings(rows(kl_behav_prox=0.2))
    assert "KL(behav‖prox) 0.2 per token" in f.evidence
    # tokens masked because the engine reported −inf are an engine fault, not staleness
    assert staleness_findings(rows(behav_masked_frac=0.12, behav_nonfinite_frac=0.11)) == []
    # an early burst that is over by the end is not flagged; too few steps say nothing
    early = rows(60)
    for r in early[:10]:
        r["behav_masked_frac"] = 0.5
    assert staleness_findings(early) == []
    assert staleness_findings(rows(2, behav_masked_frac=0.9)) == []
