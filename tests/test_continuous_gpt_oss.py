"""The continuous engine on gpt-oss (issue 55): attention sinks, alternating sliding/full layers,
YaRN RoPE, a biased top-k router and clamped-SwiGLU experts with biases (rollout/gpt_oss_block.py).
On tiny random checkpoints of transformers' GptOssForCausalLM its log-probs equal the float32 HF
forward to 1e-5 (mean and max) and its greedy tokens HF's greedy ones, on rows longer than the
window, with slots refilled as rows of different lengths finish; its routes are HF's router's
top-k; dropping the sinks, the window, the clamp or YaRN's scaling breaks the equality;
`rollout.engine=auto` picks it; a weight install is read back."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

from areal_core.rollout import gpt_oss_block
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.engine_choice import choose_local_engine
from areal_core.rollout.route_recorder import RouteRecorder
from benchmarks import tiny_checkpoints as tc
from tests.engine_gaps import logprob_gaps

TOL = 1e-5
NO_EOS = -1  # every request runs to its max_new_tokens
TEMPERATURE = 0.9

# name -> config settings beyond benchmarks/tiny_checkpoints.py's gpt_oss (window 8, 4 experts, top-2)
CASES = {
    "tiny-2_layers": {"num_hidden_layers": 2},
    "4_layers-8_experts-top3-limit1": {
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 3,
        "swiglu_limit": 1.0,  # the clamps bite
    },
}


@pytest.fixture(scope="module")
def tok():
    return tc.tokenizer()


def gpt_oss_model(name: str, tok, seed: int = 0) -> torch.nn.Module:
    """CASES[name] with its matrices drawn at std 1/√fan_in, biases at 0.1 and sinks at 1 (the
    defaults, 0.02 and ~0, leave the sinks and the routing too weak to tell apart)."""
    model = tc.model("gpt_oss", seed, tok, **CASES[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "embed" in n or "norm" in n:
                continue
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
                p.normal_(0, p.shape[-2] ** -0.5)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.normal_(0, 1.0 if n.endswith("sinks") else 0.1)
    return model


def requests(vocab: int, temperature: float = TEMPERATURE) -> tuple[list[list[int]], list[SamplingParams]]:
    """Two samples sharing a 12-token prompt and three single prompts (5 to 14 tokens), with 4 to 22
    new tokens: more requests than slots, rows finishing at different steps, most longer than
    the window (8)."""
    g = torch.Generator().manual_seed(2)
    a, b, c, d = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 5, 9, 14))
    prompts = [a, a, b, c, d]
    lengths = [22, 6, 15, 11, 4]
    params = [SamplingParams(max_new_tokens=n, temperature=temperature, seed=i) for i, n in enumerate(lengths)]
    return prompts, params


def engine_gaps(engine: ContinuousEngine, served, vocab: int) -> torch.Tensor:
    """|Δ log p| of every sampled token against the HF forward of the whole sequence."""
    prompts, params = requests(vocab)
    return logprob_gaps(served, prompts, params, engine.generate(prompts, params), TEMPERATURE)


def new_engine(model: torch.nn.Module, tok) -> ContinuousEngine:
    return ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)


@pytest.mark.parametrize("name", list(CASES))
def test_the_continuous_engine_equals_the_hf_forward_of_gpt_oss(name, tok):
    model = gpt_oss_model(name, tok)
    windows = [model.config.sliding_window if t == "sliding_attention" else None for t in model.config.layer_types]
    assert windows[:2] == [8, None] and model.model.rotary_emb.rope_type == "yarn"
    engine = new_engine(model, tok)
    assert engine.runner is None or engine.runner.windows == windows
    gaps = engine_gaps(engine, model, len(tok))
    assert engine.runner.windows == windows
    assert float(gaps.mean()) < TOL and float(gaps.max()) < TOL, f"{name}: {gaps.mean():.2e} {gaps.max():.2e}"
    assert engine.stats["prefill_shared"] >= 1  # the shared prompt computed once, copied to its row
    assert engine.stats["prefill_chunks"] >= 3  # freed slots refilled while other rows decode


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_routes_are_hfs(name, tok):
    """Greedy decoding gives HF's greedy tokens: each generated token is the argmax of the causal HF
    forward over the prompt and the tokens before it (so HF's greedy loop, step by step, makes the
    same sequence), with that forward's log-probs; the recorded routes of every position but the
    last are the top-k of HF's routers (`RouteRecorder` on that forward), in the router's order."""
    model = gpt_oss_model(name, tok)
    prompts, params = requests(len(tok), temperature=0.0)
    gens = new_engine(model, tok).generate(prompts, params)
    for p, g in zip(prompts, gens):
        seq = p + g.token_ids
        with torch.no_grad(), RouteRecorder(model) as recorder:
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
            hf_routes = recorder.take().numpy()
        assert g.token_ids == logp[len(p) - 1 : -1].argmax(-1).tolist()
        ref = logp[len(p) - 1 : -1].gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert float((ref - torch.tensor(g.logprobs)).abs().max()) < TOL
        layers, k = len(model.model.layers), model.config.num_experts_per_tok
        assert g.routes.shape == (len(seq), layers, k) and g.routes.dtype == np.uint8
        assert np.array_equal(g.routes[:-1], hf_routes[:-1].astype(np.uint8))


def _drop_sinks(runner) -> None:
    for layer in runner.layers:
        layer.sinks = None


def _drop_windows(runner) -> None:
    runner.windows = [None] * len(runner.windows)


def _drop_clamp(runner) -> None:
    for layer in runner.layers:
        layer.moe.limit = math.inf


def _drop_yarn_scaling(runner) -> None:
    runner.rot = runner.rot / runner.model.model.rotary_emb.attention_scaling


@pytest.mark.parametrize("drop", [_drop_sinks, _drop_windows, _drop_clamp, _drop_yarn_scaling])
def test_the_equality_is_not_vacuous(drop, tok):
    """The same engine without the sinks, the sliding window, the SwiGLU clamp or YaRN's attention
    scaling differs from HF by far more than TOL: each piece decides the log-probs."""
    model = gpt_oss_model("4_layers-8_experts-top3-limit1", tok)
    engine = new_engine(model, tok)
    engine._ensure_runner(64)
    drop(engine.runner)
    assert float(engine_gaps(engine, model, len(tok)).max()) > 1e-3


def test_route_is_the_checkpoints_router(tok):
    """`gpt_oss_block.route` returns transformers' GptOssTopKRouter's top-k ids and weights."""
    model = gpt_oss_model("4_layers-8_experts-top3-limit1", tok)
    hidden = torch.randn(40, model.config.hidden_size)
    for i, layer in enumerate(model.model.layers):
        ids, weights = gpt_oss_block.route(hidden, gpt_oss_block.read_gpt_oss(layer.mlp, i))
        with torch.no_grad():
            _, hf_weights, hf_ids = layer.mlp.router(hidden)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_a_weight_install_is_read_back(tok):
    """After `load_version` (a weight install) the engine's log-probs are the new weights' (sinks,
    router and expert biases included), not the old ones'."""
    name = "tiny-2_layers"
    old, new = gpt_oss_model(name, tok, seed=0), gpt_oss_model(name, tok, seed=3)
    engine = new_engine(old, tok)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))  # the runner reads the old weights
    engine.load_version(1, {k: v.clone() for k, v in new.state_dict().items()})
    assert engine.version == 1 and float(engine_gaps(engine, new, len(tok)).max()) < TOL
    assert float(engine_gaps(engine, old, len(tok)).max()) > 1e-3


def test_bfloat16_runs_within_its_precision(tok):
    """A bfloat16 engine (the default on GPUs) samples with log-probs near the float32 HF forward's."""
    model = gpt_oss_model("4_layers-8_experts-top3-limit1", tok)
    engine = ContinuousEngine(copy.deepcopy(model).to(torch.bfloat16), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    gaps = engine_gaps(engine, model, len(tok))
    assert torch.isfinite(gaps).all() and float(gaps.mean()) < 0.1


def test_auto_picks_the_continuous_engine_for_gpt_oss(tok):
    model = tc.model("gpt_oss", tok=tok)
    choice = choose_local_engine("auto", model)
    assert choice.engine == "continuous" and re.search(r"implements gpt_oss and decodes faster", choice.why)


def test_a_gpt_oss_with_another_experts_layout_is_refused(tok):
    """A layer whose experts are not gpt-oss's biased interleaved layout goes to the torch engine, named."""
    model = tc.model("gpt_oss", tok=tok)
    model.model.layers[1].mlp.experts.has_bias = False
    choice = choose_local_engine("auto", model)
    assert choice.engine == "torch" and "layer 1's experts" in choice.why
