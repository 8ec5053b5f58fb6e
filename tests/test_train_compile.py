"""`train.compile` (areal_core/train/compiled_step.py): the compiled trainer step equals the eager
one (log-probs, loss and gradients within 1e-5 in float32, and the parameters after whole steps),
over batches whose shapes change every step without a recompile storm; the choice is validated at
prepare, `auto` resolves as documented, and the log says whether the step is compiled and why."""

from __future__ import annotations

import logging

import pytest
import torch

from areal_core.config import ConfigError, load_config
from areal_core.run import pipeline
from areal_core.train import compiled_step
from areal_core.train.batch import collate
from areal_core.train.compiled_step import CompiledDecoder, compiled_modules, graph_count, resolve_compile
from areal_core.train.step import policy_logprobs, train_step
from benchmarks.tiny_run import MODEL, TINY
from tests.test_fsdp import VOCAB, fixed_batches, make_model, make_optimizer

TOL = 1e-5  # float32: the engine = trainer = HF agreement the compiled step must keep


def surrogate(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient reaches every parameter: −Σ w_t log p_t / Σ mask, fixed weights w."""
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp) * mask
    return -(weights * logp).sum() / mask.sum()


@pytest.fixture(scope="module")
def compared():
    """An eager and a compiled copy of one tiny policy, run side by side: per batch (4 shapes) the
    log-probs, loss and gradients of one forward and backward, then whole train steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order on both sides
    try:
        # every row trained, as when this bound was set: skipping zero-advantage rows changes the passes' shapes,
        # and after 4 AdamW steps at lr 1e-2 the parameters then differ by ~1.2e-5 (AdamW's 1/√v magnifies the
        # float noise of near-zero gradients); the log-prob, loss and gradient bounds hold either way
        cfg = load_config(
            None, [*MODEL, f"model.vocab_size={VOCAB}", "train.lr=1e-2", "train.skip_zero_advantage=false"]
        )
        eager, comp = make_model(cfg), make_model(cfg)
        compiled = CompiledDecoder(comp, True, "test")
        graphs_before = graph_count()
        out = {"logp": [], "loss": [], "grad": [], "inside": [], "outside": compiled_modules(comp)}
        for samples in fixed_batches():
            batch = collate(samples, 0)
            mask = batch.loss_mask.float()
            lp_e = policy_logprobs(eager, batch, None, cfg, 0)
            with compiled.active() as on:
                assert on
                out["inside"] = compiled_modules(comp)
                lp_c = policy_logprobs(comp, batch, None, cfg, 0)
            out["logp"].append(float(((lp_e - lp_c).detach().abs() * mask).sum() / mask.sum()))
            loss_e, loss_c = surrogate(lp_e, mask), surrogate(lp_c, mask)
            out["loss"].append(abs(float(loss_e - loss_c)))
            eager.zero_grad(), comp.zero_grad()
            loss_e.backward()
            loss_c.backward()
            gaps = [(a.grad - b.grad).abs().max() for a, b in zip(eager.parameters(), comp.parameters())]
            out["grad"].append(float(max(gaps)))
        opt_e, opt_c = make_optimizer(eager, cfg), make_optimizer(comp, cfg)
        out["metrics"] = []
        for samples in fixed_batches(seed=1):
            m_e = train_step(eager, opt_e, samples, cfg, 0)
            with compiled.active():
                m_c = train_step(comp, opt_c, samples, cfg, 0)
            out["metrics"].append((m_e["loss"], m_c["loss"]))
        out["params"] = max(float((a - b).abs().max()) for a, b in zip(eager.parameters(), comp.parameters()))
        out["graphs"] = graph_count() - graphs_before
        out["compiled"] = compiled
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # one inductor compile of a 1-layer policy: ~40 CPU-s
def test_compiled_logprobs_loss_and_gradients_equal_the_eager_ones(compared):
    assert len(compared["logp"]) == 4
    assert max(compared["logp"]) < TOL, compared["logp"]  # mean |Δ log p| over response tokens
    assert max(compared["loss"]) < TOL, compared["loss"]
    assert max(compared["grad"]) < TOL, compared["grad"]


@pytest.mark.slow  # one inductor compile of a 1-layer policy: ~40 CPU-s
def test_compiled_train_steps_keep_the_eager_loss_and_parameters(compared):
    for loss_e, loss_c in compared["metrics"]:
        assert loss_c == pytest.approx(loss_e, abs=TOL)
    assert compared["params"] < TOL  # after 4 AdamW steps at lr 1e-2


@pytest.mark.slow  # one inductor compile of a 1-layer policy: ~40 CPU-s
def test_the_decoder_runs_compiled_only_inside_a_step_with_few_graphs(compared):
    """Compiled for real (the equality is not eager against eager), only the decoder, only while a
    step runs; eight batches of changing shapes (grad and no-grad) stay within the graph cap."""
    assert compared["graphs"] >= 1
    assert compared["inside"] == ["model"] and compared["outside"] == []
    assert compared["compiled"].on and compared["compiled"].graphs <= compiled_step.MAX_GRAPHS


def test_a_recompile_storm_turns_the_step_eager_with_a_logged_reason(monkeypatch, caplog):
    cfg = load_config(None, [*MODEL, f"model.vocab_size={VOCAB}"])
    compiled = CompiledDecoder(make_model(cfg), True, "test")
    counts = iter([0, compiled_step.MAX_GRAPHS, 2 * compiled_step.MAX_GRAPHS, 2 * compiled_step.MAX_GRAPHS + 1])
    monkeypatch.setattr(compiled_step, "graph_count", lambda: next(counts))
    with compiled.active() as on:
        assert on
    assert compiled.on  # MAX_GRAPHS graphs: still compiled
    with caplog.at_level(logging.WARNING, logger="areal.trainer"), compiled.active() as on:
        assert on
    assert not compiled.on and f"> {compiled_step.MAX_GRAPHS}" in compiled.reason
    assert "eager from now on" in caplog.text
    with compiled.active() as on:
        assert not on


def test_a_step_with_images_or_replayed_routes_runs_eager(caplog):
    """Eager, and the log says why, once per reason (train.compile=on's description promises it)."""
    cfg = load_config(None, [*MODEL, f"model.vocab_size={VOCAB}"])
    compiled = CompiledDecoder(make_model(cfg), True, "test")
    with caplog.at_level(logging.INFO, logger="areal.trainer"):
        for _ in range(2):
            with compiled.active(compiled_step.step_eager_reason(object(), False)) as on:
                assert not on
    said = [r.getMessage() for r in caplog.records if "eager for" in r.getMessage()]
    assert said == ["trainer step: eager for an image batch (train.compile cannot compile such a step)"]
    assert compiled.on  # the next text batch still runs compiled
    assert compiled_step.step_eager_reason(None, True) == "replayed MoE routes"
    assert compiled_step.step_eager_reason(None, False) == ""


def test_a_bogus_compile_choice_is_refused_at_prepare(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"'train.compile' must be one of 'auto', 'on' or 'off', got 'bogus'"):
        pipeline.prepare("", [*TINY, f"store={root}", "train.compile=bogus"])
    assert not root.exists() or not any(root.iterdir())  # nothing claimed, nothing written
    with pytest.raises(ValueError, match="train.compile"):
        resolve_compile("bogus", "cpu")


@pytest.mark.parametrize(
    "choice,device,want",
    [("auto", "cpu", False), ("auto", "cuda", False), ("auto", "cuda:1", False), ("on", "cpu", True)]
    + [("on", "cuda", True), ("off", "cpu", False), ("off", "cuda", False)],
)
def test_choices_resolve_as_documented(choice, device, want):
    """auto: eager on CPU (measured: a cold compile is not repaid within the default job,
    docs/benchmarks.md) and on accelerators (not measured); on/off as said."""
    enabled, reason = resolve_compile(choice, device)
    assert enabled is want and f"train.compile={choice}" in reason
    assert load_config("configs/default.yaml", []).train.compile == "auto"
    assert load_config(None, [f"train.compile={choice}"]).train.compile == choice  # YAML's on/off booleans: words


def test_the_log_says_whether_the_step_is_compiled_and_why(caplog):
    cfg = load_config(None, [*MODEL, f"model.vocab_size={VOCAB}"])
    model = make_model(cfg)
    with caplog.at_level(logging.INFO, logger="areal.trainer"):
        auto = CompiledDecoder.for_run(model, "auto", "cpu", distributed=False)
        sharded = CompiledDecoder.for_run(model, "on", "cpu", distributed=True)
        on = CompiledDecoder.for_run(model, "on", "cpu", distributed=False)
    assert not auto.on and not sharded.on and on.on
    lines = [r.getMessage() for r in caplog.records]
    assert "trainer step: eager (train.compile=auto: eager on CPU" in lines[0]
    assert "trainer step: eager (train.compile=on, but FSDP2 shards the parameters: eager)" == lines[1]
    assert "trainer step: compiled (train.compile=on)" == lines[2]
