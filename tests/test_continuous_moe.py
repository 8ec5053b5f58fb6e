"""The continuous engine on Qwen2-MoE and Qwen3-MoE (issue 55): its behaviour log-probs equal the
HF forward of tiny random checkpoints of the real transformers classes to 1e-5 in float32 (mean
and max), with continuous batching over rows of different lengths, shared prompts, shared experts,
norm_topk_prob and dense layers mixed in; its router is transformers' own; the experts run grouped
by expert over all rows; `rollout.engine=auto` picks it."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

from areal_core.rollout import moe_block
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.engine_choice import choose_local_engine
from areal_core.rollout.factory import local_engine_kind
from benchmarks import tiny_checkpoints as tc
from tests.engine_gaps import logprob_gaps

TOL = 1e-5
NO_EOS = -1  # every request runs to its max_new_tokens

# name -> (architecture, config settings beyond benchmarks/tiny_checkpoints.py's)
CASES = {
    "qwen3_moe-norm_topk-dense_layer": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-8_experts-top3": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3, "mlp_only_layers": [2]}),
    "qwen2_moe-shared-dense_first": ("qwen2_moe", {"mlp_only_layers": [0]}),
    "qwen2_moe-shared-sparse_step_2": ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),
}


@pytest.fixture(scope="module")
def tok():
    return tc.tokenizer()


def moe_model(name: str, tok, seed: int = 0) -> torch.nn.Module:
    """CASES[name] with 3 layers, its matrices drawn at std 1/√fan_in (the default 0.02 leaves
    the experts' outputs too small to tell one routing from another)."""
    arch, extra = CASES[name]
    model = tc.model(arch, seed, tok, num_hidden_layers=3, **extra)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in n:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Two groups of 3 samples sharing their prompt (12 and 5 tokens) and two single prompts, with
    4 to 19 new tokens each: more requests than slots, rows of different lengths."""
    g = torch.Generator().manual_seed(2)
    a, b, c, d = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 5, 9, 14))
    prompts = [a, a, a, b, b, b, c, d]
    lengths = [19, 6, 11, 4, 15, 9, 13, 7]
    return prompts, [SamplingParams(max_new_tokens=n, temperature=0.9, seed=i) for i, n in enumerate(lengths)]


def engine_gaps(engine: ContinuousEngine, served, vocab: int) -> torch.Tensor:
    """|Δ log p| of every sampled token against the HF forward of the whole sequence."""
    prompts, params = requests(vocab)
    return logprob_gaps(served, prompts, params, engine.generate(prompts, params), 0.9)


@pytest.mark.parametrize("name", list(CASES))
def test_the_continuous_engine_equals_the_hf_forward_of_each_moe(name, tok):
    model = moe_model(name, tok)
    layers = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert any("Sparse" in t for t in layers) and not all("Sparse" in t for t in layers)  # dense layers mixed in
    engine = ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    gaps = engine_gaps(engine, model, len(tok))
    assert float(gaps.mean()) < TOL and float(gaps.max()) < TOL, f"{name}: {gaps.mean():.2e} {gaps.max():.2e}"
    assert engine.stats["prefill_shared"] >= 2  # a group's prompt computed once, copied to its rows
    assert engine.stats["prefill_chunks"] >= 3  # freed slots refilled while other rows decode
    assert local_engine_kind("auto", model) == "continuous"


def test_the_equality_is_not_vacuous(tok):
    """The same engine with norm_topk_prob flipped in its router differs from HF by far more than
    TOL: the checkpoints' routing decides the log-probs."""
    model = moe_model("qwen3_moe-norm_topk-dense_layer", tok)
    engine = ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    engine._ensure_runner(64)
    for layer in engine.runner.layers:
        if layer.moe is not None:
            layer.moe.router.normalize = False
    assert float(engine_gaps(engine, model, len(tok)).max()) > 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe-norm_topk-dense_layer", "qwen2_moe-shared-dense_first"])
def test_route_is_the_checkpoints_router(name, tok):
    """`moe_block.route` (the one place experts are chosen) returns transformers' router's top-k
    ids and weights."""
    model = moe_model(name, tok)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    hidden = torch.randn(40, model.config.hidden_size)
    for i in sparse:
        block = moe_block.read_moe(model.model.layers[i].mlp, i)
        ids, weights = moe_block.route(hidden, block.router)
        with torch.no_grad():
            _, hf_weights, hf_ids = model.model.layers[i].mlp.gate(hidden)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_experts_run_grouped_by_expert_with_or_without_grouped_mm(monkeypatch):
    """The grouped path equals a per-token sum over its k experts, through F.grouped_mm and
    through the per-expert fallback, and calls one GEMM per expert weight for all tokens."""
    g = torch.Generator().manual_seed(0)
    T, k, E, H, inner = 37, 3, 6, 16, 8
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * inner, H, generator=g), torch.randn(E, H, inner, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:5] = torch.tensor([0, 1, 2])  # expert 5 may get no token at all: an empty group
    weights = torch.rand(T, k, generator=g)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            gt, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * down[ids[t, j]] @ (torch.nn.functional.silu(gt) * up)
    calls = []
    real = moe_block.grouped_linear
    monkeypatch.setattr(moe_block, "grouped_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    for grouped in (True, False):
        monkeypatch.setitem(moe_block._GROUPED_MM_OK, ("cpu", torch.float32), grouped)
        got = moe_block.grouped_experts_into(torch.zeros(T, H), x, ids, weights, gate_up, down)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5)
    assert calls == [gate_up.shape, down.shape] * 2


def test_a_weight_swap_rereads_the_experts_and_the_shared_expert(tok):
    name = "qwen2_moe-shared-dense_first"
    old, new = moe_model(name, tok, seed=0), moe_model(name, tok, seed=3)
    engine = ContinuousEngine(copy.deepcopy(old), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))  # the runner reads the old weights
    engine.load_version(1, {k: v.clone() for k, v in new.state_dict().items()})
    gaps = engine_gaps(engine, new, len(tok))
    assert engine.version == 1 and float(gaps.max()) < TOL


def test_bfloat16_runs_the_same_routes_within_its_precision(tok):
    """A bfloat16 engine (the default on GPUs) samples with log-probs near the float32 HF forward's."""
    model = moe_model("qwen2_moe-shared-sparse_step_2", tok)
    engine = ContinuousEngine(copy.deepcopy(model).to(torch.bfloat16), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    gaps = engine_gaps(engine, model, len(tok))
    assert torch.isfinite(gaps).all() and float(gaps.mean()) < 0.1


# -- rollout.engine=auto: which engine, and why, in the log, the events and the report ---------------


@pytest.mark.parametrize(
    ("arch", "engine", "why"),
    [
        ("qwen3_moe", "continuous", r"implements qwen3_moe and decodes faster"),
        ("qwen2_moe", "continuous", r"implements qwen2_moe"),
        ("deepseek_v3", "continuous", r"implements deepseek_v3"),
        ("gpt_oss", "continuous", r"implements gpt_oss"),
    ],
)
def test_auto_says_which_engine_and_why(arch, engine, why, tok):
    model = tc.model(arch, tok=tok)
    choice = choose_local_engine("auto", model)
    assert (choice.setting, choice.engine) == ("auto", engine) and re.search(why, choice.why)
    assert local_engine_kind("auto", model) == engine
    assert choose_local_engine("torch", model).engine == "torch"


def test_the_worker_logs_the_choice_and_the_report_shows_it(tok, caplog):
    from areal_core.config import load_config
    from areal_core.report import series
    from areal_core.rollout.factory import build_local_engine

    cfg = load_config(None, ["rollout.engine=auto"])
    with caplog.at_level(logging.INFO, logger="areal.rollout"):
        engine = build_local_engine(cfg, moe_model("qwen2_moe-shared-dense_first", tok), tok, 0, seed=0)
    assert isinstance(engine, ContinuousEngine)
    assert "rollout.engine=auto runs the continuous engine: the continuous engine implements qwen2_moe" in caplog.text
    records = [{"t": 1.0, "kind": "engine", "role": "rollout", "worker": "0", **engine.choice.fields()}]
    assert series.engine_choices(records) == [
        "continuous (rollout.engine=auto: the continuous engine implements qwen2_moe and decodes faster than the "
        "torch engine (docs/benchmarks.md); rollout-0)"
    ]


@pytest.mark.slow
def test_three_steps_of_a_qwen3_moe_on_auto_run_the_continuous_engine(tmp_path):
    """A run of a tiny Qwen3-MoE checkpoint with rollout.engine=auto: the worker's `engine` event
    and the report name the continuous engine and why; at η = 0 its behaviour log-probs equal the
    trainer's (the engine/trainer gap alone) step after step."""
    import json

    from areal_core.events import read_events
    from areal_core.layout import LAYOUT
    from areal_core.report.html import build_report
    from tests.test_architectures import three_steps

    # every row trained: a step whose rows all had advantage 0 would measure no gap (train.skip_zero_advantage)
    overrides = ["rollout.engine=auto", "train.skip_zero_advantage=false"]
    store = three_steps(tc.save("qwen3_moe", tmp_path / "qwen3_moe"), tmp_path, overrides)
    chosen = [r for r in read_events(store) if r["kind"] == "engine"]
    assert chosen and all(r["engine"] == "continuous" and r["setting"] == "auto" for r in chosen)
    rows = [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]
    assert len(rows) == 3 and max(r["abs_dlogp_behav_prox"] for r in rows) < TOL
    assert "continuous (rollout.engine=auto: the continuous engine implements qwen3_moe" in build_report(store.url(""))


def test_one_decode_step_routes_and_runs_the_experts_once_per_layer_for_all_rows(tok, monkeypatch):
    """The experts are batched across sequences: a decode step over 5 rows calls the router once
    and each expert weight's grouped GEMM once per sparse layer, on all 5 rows' tokens."""
    model = moe_model("qwen2_moe-shared-dense_first", tok)
    engine = ContinuousEngine(model, tok.pad_token_id, NO_EOS, slots=5, seed=1)
    engine.generate([[5, 6, 7, 8]] * 5, SamplingParams(max_new_tokens=2))
    sparse = sum(layer.moe is not None for layer in engine.runner.layers)
    routed, gemms = [], []
    real_route, real_linear = moe_block.route, moe_block.grouped_linear
    monkeypatch.setattr(moe_block, "route", lambda h, g: routed.append(h.shape[0]) or real_route(h, g))
    monkeypatch.setattr(moe_block, "grouped_linear", lambda x, w, o: gemms.append(x.shape[0]) or real_linear(x, w, o))
    engine.runner.decode(torch.tensor([9, 10, 11, 12, 13]), torch.full((5,), 4), 5)
    top_k = model.config.num_experts_per_tok
    assert sparse == 2 and routed == [5] * sparse and gemms == [5 * top_k] * (2 * sparse)
