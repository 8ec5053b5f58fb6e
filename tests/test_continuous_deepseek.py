"""The continuous engine on DeepSeek-V3 (issue 55): multi-head latent attention over the static
cache (mla_decoder.py), a dense first layer, shared experts and the sigmoid, bias-corrected,
group-limited router (deepseek_moe.py). Its behaviour log-probs and greedy tokens equal the float32
HF forward of tiny random DeepseekV3ForCausalLM checkpoints to 1e-5, with rows of different lengths
refilled and compacted; its recorded routes are HF's router's top-k; `rollout.engine=auto` picks it;
a weight swap (a merged LoRA adapter) is read back."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.deepseek_moe import read_deepseek_moe, route_deepseek
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.engine_choice import choose_local_engine
from areal_core.rollout.mla_decoder import MlaCacheDecoder
from areal_core.rollout.route_recorder import RouteRecorder
from areal_core.routes import not_recorded
from areal_core.train.lora import adapter_files, apply_lora, merge_adapter
from benchmarks import tiny_checkpoints as tc
from tests.engine_gaps import hf_logits, logprob_gaps

TOL = 1e-5
NO_EOS = -1  # every request runs to its max_new_tokens
TEMPERATURE = 0.9
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}

# name -> config settings beyond benchmarks/tiny_checkpoints.py's deepseek_v3 (3 layers, the first dense)
CASES = {
    # 8 experts in 4 groups, 2 groups kept; YaRN with mscale_all_dim (the softmax scale's mscale²);
    # interleaved RoPE; v_head_dim 12 ≠ the key's 8 + 8
    "groups-yarn-interleave": {
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "v_head_dim": 12,
        "rope_interleave": True,
        "rope_parameters": YARN | {"mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # q straight from q_proj (no q_lora_rank), rotate-half RoPE, attention biases, 2 shared experts,
    # unnormalised top-k weights, top-3
    "q_proj-rotate_half-bias": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "attention_bias": True,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_experts_per_tok": 3,
        "v_head_dim": 24,
    },
}


@pytest.fixture(scope="module")
def tok():
    return tc.tokenizer()


def deepseek(name: str, tok, seed: int = 0) -> torch.nn.Module:
    """CASES[name] with 3 layers; matrices drawn at std 1/√fan_in and the router's score correction
    bias at std 0.3 (at transformers' init, 0.02 and zeros, routing barely matters)."""
    model = tc.model("deepseek_v3", seed, tok, num_hidden_layers=3, **CASES[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in n:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return model


def requests(vocab: int, greedy: bool = False) -> tuple[list[list[int]], list[SamplingParams]]:
    """Two groups of 3 samples sharing their prompt (12 and 5 tokens) and two single prompts, with
    4 to 19 new tokens each: more requests than slots, rows of different lengths."""
    g = torch.Generator().manual_seed(2)
    a, b, c, d = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 5, 9, 14))
    prompts = [a, a, a, b, b, b, c, d]
    lengths = [19, 6, 11, 4, 15, 9, 13, 7]
    params = [SamplingParams(max_new_tokens=n, temperature=TEMPERATURE, seed=i) for i, n in enumerate(lengths)]
    if greedy:
        params = [SamplingParams(max_new_tokens=n, greedy=True) for n in lengths]
    return prompts, params


def engine_gaps(engine: ContinuousEngine, served, vocab: int) -> torch.Tensor:
    """|Δ log p| of every sampled token against the HF forward of the whole sequence."""
    prompts, params = requests(vocab)
    return logprob_gaps(served, prompts, params, engine.generate(prompts, params), TEMPERATURE)


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_generations_equal_the_hf_forward(name, tok):
    model = deepseek(name, tok)
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # the dense first layer
    engine = ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    gaps = engine_gaps(engine, model, len(tok))
    assert isinstance(engine.runner, MlaCacheDecoder)
    assert float(gaps.mean()) < TOL and float(gaps.max()) < TOL, f"{name}: {gaps.mean():.2e} {gaps.max():.2e}"
    assert engine.stats["prefill_shared"] >= 2  # a group's prompt computed once, copied to its rows
    assert engine.stats["prefill_chunks"] >= 3  # freed slots refilled while other rows decode


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_are_hfs_and_routes_are_hfs_routers(name, tok):
    """Each greedy token is the argmax of HF's logits on the same prefix (so the tokens are HF's
    greedy decoding) with HF's log-prob; each generation's routes ([tokens, 2 sparse layers, k],
    the last token's not recorded) are what transformers' router chooses in that HF forward."""
    model = deepseek(name, tok)
    engine = ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    prompts, params = requests(len(tok), greedy=True)
    gens = engine.generate(prompts, params)
    k, gaps = model.config.num_experts_per_tok, []
    for p, sp, g in zip(prompts, params, gens):
        seq = p + g.token_ids
        with RouteRecorder(model) as rec:
            logits = hf_logits(model, seq)[len(p) - 1 : -1]
            ref = rec.take()
        assert len(g.token_ids) == sp.max_new_tokens and g.token_ids == logits.argmax(-1).tolist()
        chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        gaps.append((chosen - torch.tensor(g.logprobs)).abs())
        assert g.routes.shape == (len(seq), 2, k) and ref.shape == (len(seq), 2, k)
        assert (g.routes[-1] == not_recorded(g.routes.dtype)).all()
        got = torch.from_numpy(g.routes[:-1].astype("int64"))
        assert torch.equal(got.sort(-1).values, ref[:-1].sort(-1).values)
    gaps = torch.cat(gaps)
    assert float(gaps.mean()) < TOL and float(gaps.max()) < TOL, f"{name}: {gaps.mean():.2e} {gaps.max():.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_route_is_the_checkpoints_router(name, tok):
    """`route_deepseek` returns transformers' DeepseekV3TopkRouter's ids (same order) and weights."""
    model = deepseek(name, tok)
    hidden = torch.randn(40, model.config.hidden_size)
    for i, layer in enumerate(model.model.layers[1:], start=1):
        ids, weights = route_deepseek(hidden, read_deepseek_moe(layer.mlp, i).router)
        with torch.no_grad():
            _, hf_weights, hf_ids = layer.mlp.gate(hidden)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_the_equality_is_not_vacuous(tok):
    """The engine with the router's score correction bias or the YaRN mscale dropped differs from HF
    by far more than TOL: the checkpoint's routing and softmax scale decide the log-probs."""
    model = deepseek("groups-yarn-interleave", tok)
    assert model.model.layers[0].self_attn.scaling != model.config.qk_head_dim**-0.5  # mscale² applies
    for spoil in ("bias", "scale"):
        engine = ContinuousEngine(copy.deepcopy(model), tok.pad_token_id, NO_EOS, slots=3, seed=1)
        engine._ensure_runner(64)
        if spoil == "bias":
            for layer in engine.runner.layers[1:]:
                layer.moe.router.bias = torch.zeros_like(layer.moe.router.bias)
        else:
            engine.runner.scale = model.config.qk_head_dim**-0.5
        assert float(engine_gaps(engine, model, len(tok)).max()) > 1e-3, spoil


def test_a_swap_to_merged_lora_weights_is_read_back(tok):
    """A LoRA adapter on every default target (MLA projections, the dense and shared MLPs, the routed
    experts), merged, then installed in a running engine with a new score correction bias: `refresh`
    re-reads every weight, and the engine equals the merged model's HF forward."""
    base = deepseek("groups-yarn-interleave", tok)
    peft = apply_lora(copy.deepcopy(base), r=4, alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    merged = copy.deepcopy(base)
    merge_adapter(merged, adapter_files(peft))
    with torch.no_grad():
        merged.model.layers[2].mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    engine = ContinuousEngine(copy.deepcopy(base), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))  # the runner reads the base weights
    assert float(engine_gaps(engine, merged, len(tok)).max()) > 1e-3  # the adapter matters
    engine.load_version(1, {k: v.clone() for k, v in merged.state_dict().items()})
    gaps = engine_gaps(engine, merged, len(tok))
    assert engine.version == 1 and float(gaps.mean()) < TOL and float(gaps.max()) < TOL


def test_bfloat16_runs_within_its_precision(tok):
    model = deepseek("q_proj-rotate_half-bias", tok)
    engine = ContinuousEngine(copy.deepcopy(model).to(torch.bfloat16), tok.pad_token_id, NO_EOS, slots=3, seed=1)
    gaps = engine_gaps(engine, model, len(tok))
    assert torch.isfinite(gaps).all() and float(gaps.mean()) < 0.1


def test_auto_picks_the_continuous_engine_for_deepseek_v3(tok):
    choice = choose_local_engine("auto", tc.model("deepseek_v3", tok=tok))
    assert choice.engine == "continuous" and "implements deepseek_v3" in choice.why
    gqa = tc.config("deepseek_v3", tok)
    gqa.num_key_value_heads = 2
    choice = choose_local_engine("auto", transformers.AutoModelForCausalLM.from_config(gqa))
    assert choice.engine == "torch" and "num_key_value_heads" in choice.why
