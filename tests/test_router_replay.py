"""Routing replay (issue 55): an MoE engine records its experts per token and layer, the routes
travel in the shard's `routes` column, and with algo.router_replay=rollout the trainer's π_θ and
π_prox forwards run on them (areal_core/routes.py, rollout/route_recorder.py, train/router_replay.py).

The model is a tiny Qwen3-MoE of the real transformers class with Qwen3-30B-A3B-like routing
(64 experts, top-8; benchmarks/router_replay.py:tiny_moe): many experts, so near-ties between a
token's 8th and 9th choice are common, as in the real model, and a bfloat16 engine routes some
tokens differently from the float32 trainer; its experts carry the residual stream (std 0.1), so a
different expert moves the log-probs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from areal_core.config import load_config
from areal_core.protocol import Sample, ShardError, ShardLimits, decode_shard, encode_shard, to_table
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.routes import RouteShape, not_recorded
from areal_core.train.batch import collate, route_sentinel
from areal_core.train.lora import set_gradient_checkpointing
from areal_core.train.parts import make_optimizer
from areal_core.train.router_replay import RouteReplay, RouteTally
from areal_core.train.step import train_step
from benchmarks import tiny_checkpoints as tc
from benchmarks.router_replay import EXPERTS, TOP_K, tiny_moe

TOK = tc.tokenizer()
PROMPTS = [torch.randint(3, len(TOK), (10 + j,), generator=torch.Generator().manual_seed(j)).tolist() for j in range(4)]
PROMPTS = [
    p for p in PROMPTS for _ in range(2)
]  # groups of 2 share their prompt (the continuous engine prefills it once)


def generate(model: torch.nn.Module, dtype: torch.dtype, kind: str = "torch") -> list[Sample]:
    """8 samples (4 groups of 2, rewards 0 and 1) of 24 sampled tokens, by an engine running `model` in `dtype`."""
    engine_class = TorchEngine if kind == "torch" else ContinuousEngine
    engine = engine_class(copy.deepcopy(model).to(dtype), TOK.pad_token_id, TOK.eos_token_id, seed=0)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    return [
        Sample(
            sample_id=f"s{i}",
            group_id=f"g{i // 2}",
            prompt_id="p",
            worker_id="w",
            input_ids=p + g.token_ids,
            prompt_len=len(p),
            loss_mask=[0] * len(p) + [1] * len(g.token_ids),
            behav_logprobs=[0.0] * len(p) + g.logprobs,
            versions=[-1] * len(p) + [0] * len(g.token_ids),
            reward=float(i % 2),
            routes=g.routes,
        )
        for i, (p, g) in enumerate(zip(PROMPTS, gens))
    ]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_moe(TOK)


@pytest.fixture(scope="module")
def rollouts(model) -> dict[torch.dtype | str, list[Sample]]:
    out: dict[torch.dtype | str, list[Sample]] = {
        dtype: generate(model, dtype) for dtype in (torch.float32, torch.bfloat16)
    }
    out["continuous"] = generate(model, torch.float32, "continuous")
    return out


def own_agreement(model: torch.nn.Module, samples: list[Sample]) -> tuple[float, int]:
    """(routing agreement, token-layers recorded) of the float32 trainer's own routes against the samples'."""
    batch = collate(samples, TOK.pad_token_id)
    tally = RouteTally()
    with torch.no_grad(), RouteReplay(model, batch.routes, force=False, tally=tally):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return tally.agreement, tally.recorded


def test_the_engine_records_the_routes_of_every_position_it_computed(model, rollouts):
    """Routes cover prompt and response, every position but the last (which no forward reads); a
    float32 engine's, torch or continuous (a group's shared prompt prefilled once), are the trainer's
    own (so each is recorded at its position), while a bfloat16 engine and the float32 trainer
    disagree on at least 1% of token-layer routes."""
    for s in rollouts[torch.float32] + rollouts[torch.bfloat16] + rollouts["continuous"]:
        assert s.routes.shape == (len(s.input_ids), 2, TOP_K) and s.routes.dtype == np.uint8
        assert (s.routes[:-1] < EXPERTS).all() and (s.routes[-1] == not_recorded(np.uint8)).all()
        assert all(len(set(choice)) == TOP_K for choice in s.routes[:-1].reshape(-1, TOP_K).tolist())
    fp32, recorded = own_agreement(model, rollouts[torch.float32])
    continuous, _ = own_agreement(model, rollouts["continuous"])
    bf16, _ = own_agreement(model, rollouts[torch.bfloat16])
    assert recorded == 2 * sum(len(s.input_ids) - 1 for s in rollouts[torch.float32])
    assert fp32 >= 0.998 and continuous >= 0.998, (fp32, continuous)
    assert bf16 <= 0.99, bf16


def test_routes_travel_in_the_shard_and_old_shards_still_decode(rollouts):
    samples = rollouts[torch.bfloat16][:2]
    fits = ShardLimits(routes=RouteShape(2, TOP_K, EXPERTS))
    back = decode_shard(encode_shard(samples), fits)
    assert all(np.array_equal(a.routes, b.routes) and b.routes.dtype == np.uint8 for a, b in zip(samples, back))
    old = decode_shard(ipc(to_table(samples).drop_columns(["routes"])), fits)  # written before the column existed
    assert [s.routes for s in old] == [None, None] and old[0].input_ids == samples[0].input_ids
    with pytest.raises(ShardError, match="routes of 2 × top-8 .* the model has 2 × top-4"):
        decode_shard(encode_shard(samples), ShardLimits(routes=RouteShape(2, 4, EXPERTS)))
    with pytest.raises(ShardError, match=r"expert id 63 outside \[0, 32\)"):
        decode_shard(encode_shard(samples), ShardLimits(routes=RouteShape(2, TOP_K, 32)))
    table = to_table(samples)
    cut = [dict(v, ids=v["ids"][:-1]) for v in table["routes"].to_pylist()]  # a byte short of tokens × 2 × 8
    with pytest.raises(ShardError, match="routes of .* bytes for"):
        decode_shard(ipc(table.set_column(table.schema.get_field_index("routes"), "routes", [cut])), fits)


def ipc(table) -> bytes:  # noqa: ANN001 - an Arrow table as the shard file a writer makes
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def dense_forced_block(block: torch.nn.Module, recorded: torch.Tensor, known: torch.Tensor):
    """A Qwen3-MoE block's forward written out here, on the recorded experts: z = W_g h, p = softmax(z),
    e = the recorded experts (the top-k of p where none), w = p_e (/ Σ p_e with norm_topk_prob), and
    Σ_j w_j · expert_{e_j}(h), every expert computed densely and the chosen ones gathered."""

    def forward(h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        p = torch.softmax(x @ block.gate.weight.T, dim=-1)
        e = torch.where(known[:, None], recorded, p.topk(TOP_K, dim=-1).indices)
        w = p.gather(-1, e)
        if block.gate.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        gate, up = torch.einsum("td,eod->teo", x, block.experts.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,edi->ted", torch.nn.functional.silu(gate) * up, block.experts.down_proj)
        return (y.gather(1, e[..., None].expand(-1, -1, x.shape[-1])) * w[..., None]).sum(1).reshape(h.shape)

    return forward


def logprobs(model: torch.nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    """[N, T] log π(x_t | x_<t) (0 at t = 0) of a plain float32 forward."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def forced_reference(model: torch.nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    """The log-probs of an independent forward forced to the batch's recorded routes (dense_forced_block)."""
    forced = copy.deepcopy(model)
    blocks = [m for m in forced.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    routes, sentinel = batch.routes.reshape(-1, len(blocks), TOP_K).long(), route_sentinel(batch.routes)
    for layer, block in enumerate(blocks):
        block.forward = dense_forced_block(block, routes[:, layer], (routes[:, layer] != sentinel).all(-1))
    return logprobs(forced, batch)


def step_stats(model: torch.nn.Module, samples: list[Sample], overrides: list[str]) -> dict[str, float]:
    cfg = load_config(None, ["train.batch_groups=4", "rollout.temperature=1.0", "train.lr=1e-3", *overrides])
    trained = copy.deepcopy(model)
    return train_step(trained, make_optimizer(trained, cfg, False), samples, cfg, TOK.pad_token_id)


def test_with_replay_the_trainer_scores_tokens_under_the_rollout_routes(model, rollouts):
    """The behaviour log-probs are set to those of an independent forward forced to the bfloat16
    engine's routes: with algo.router_replay=rollout the trainer's π_prox (the detached π_θ forward,
    or a separate pass with 2 minibatches) equals them; without, it differs where the routes do."""
    samples = copy.deepcopy(rollouts[torch.bfloat16])
    batch = collate(samples, TOK.pad_token_id)
    reference, own = forced_reference(model, batch), logprobs(model, batch)
    mask = batch.loss_mask.bool()
    assert float((reference - own)[mask].abs().mean()) > 1e-3  # the routes matter to these tokens
    for s, lp in zip(samples, reference):
        s.behav_logprobs = lp[: len(s.input_ids)].tolist()
    for minibatches in (1, 2):
        stats = step_stats(model, samples, ["algo.router_replay=rollout", f"train.ppo_minibatches={minibatches}"])
        assert stats["abs_dlogp_behav_prox"] < 1e-5, stats
    plain = step_stats(model, samples, ["algo.router_replay=none"])
    assert abs(plain["abs_dlogp_behav_prox"] - float((reference - own)[mask].abs().mean())) < 1e-5
    for s in (stats, plain):  # the probe: the same numbers whichever way the trainer runs
        assert s["abs_dlogp_behav_replay"] < 1e-5 and s["abs_dlogp_behav_own"] > 1e-3
        assert s["route_agreement"] <= 0.99 and s["iw_std_own"] > 10 * s["iw_std_replay"]


def test_replayed_routes_hold_through_a_checkpointed_backward(model, rollouts):
    """Gradient checkpointing recomputes each layer, router included, in the backward: the trainer
    holds the replay until the backward ends, so one SGD step (lr 1: the update is the gradient)
    moves every parameter, the routers' included, as the step without checkpointing does."""
    cfg = load_config(None, ["train.batch_groups=4", "rollout.temperature=1.0", "algo.router_replay=rollout"])

    def stepped(checkpointing: bool) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model).train()
        set_gradient_checkpointing(m, checkpointing)
        train_step(m, torch.optim.SGD(m.parameters(), lr=1.0), rollouts[torch.bfloat16], cfg, TOK.pad_token_id)
        return {n: p.detach() - q.detach() for (n, p), q in zip(m.named_parameters(), model.parameters())}

    plain, checkpointed = stepped(False), stepped(True)
    assert any(float(d.abs().max()) > 1e-4 for n, d in plain.items() if "gate.weight" in n)  # the routers train
    assert all(torch.allclose(plain[n], checkpointed[n], atol=1e-6) for n in plain)


def drift_rows(own: float, replay: float, prox: float) -> list[dict[str, float]]:
    keys = dict(abs_dlogp_behav_own=own, abs_dlogp_behav_replay=replay, abs_dlogp_behav_prox=prox)
    return [{"step": s, "route_agreement": 0.95, "iw_std_own": 0.02, "iw_std_replay": 0.001, **keys} for s in (1, 2, 3)]


def test_the_doctor_says_when_routing_drift_not_staleness_drives_the_importance_weights():
    from areal_core.report.doctor import diagnose, routing_drift

    (finding,) = [f for f in diagnose([], drift_rows(0.005, 0.001, prox=0.005)) if "routing" in f.title]
    assert finding.kind == "health" and finding.title == "routing drift, not staleness, drives the importance weights"
    assert "95.0% of token-layers" in finding.evidence and "0.005 under its own routes and 0.001" in finding.evidence
    assert "replay removes 80%" in finding.evidence and "algo.router_replay=rollout" in finding.advice
    (replaying,) = routing_drift(drift_rows(0.005, 0.001, prox=0.001))  # the trainer already replays
    assert replaying.kind == "info" and replaying.title == "routing replay removes the routing drift"
    assert routing_drift(drift_rows(0.005, 0.004, prox=0.005)) == []  # replay removes 20%: not the routes
    assert routing_drift(drift_rows(0.0005, 0.0001, prox=0.0005)) == []  # nothing to explain
    assert routing_drift(drift_rows(0.005, 0.001, prox=0.005)[:2]) == []  # too few steps


@pytest.mark.slow
def test_a_short_run_with_replay_reaches_done_with_the_route_metrics(tmp_path):
    """3 synchronous steps of the tiny MoE, a bfloat16 torch engine and the float32 trainer with
    algo.router_replay=rollout: DONE, and every step logs the route metrics; the trainer's own gap is
    the replayed one (it replays), below the gap under its own routes."""
    from benchmarks.router_replay import COLUMNS, run

    # every row trained: the pass's abs_dlogp_behav_prox is then over the same rows as the probe's replay gap
    # (with zero-advantage rows skipped it is over the trained rows only)
    extra = ["train.eta=0", "train.lr=1e-4", "rollout.max_new_tokens=12", "train.skip_zero_advantage=false"]
    rows = run(tmp_path, 3, "rollout", extra)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(c in r for c in COLUMNS) and r["route_token_layers"] > 0
        assert r["route_agreement"] < 0.995
        assert abs(r["abs_dlogp_behav_prox"] - r["abs_dlogp_behav_replay"]) < 1e-6
        assert r["abs_dlogp_behav_replay"] < r["abs_dlogp_behav_own"]


def test_prepare_refuses_router_replay_without_an_moe_whose_engine_records_routes(model):
    from areal_core.config import ConfigError
    from areal_core.run.preflight import Preflight
    from areal_core.run.preflight_routing import check_router_replay

    def check(overrides: list[str], m: torch.nn.Module | None) -> str:
        ctx = Preflight(load_config(None, ["algo.router_replay=rollout", *overrides]), [], model=m)
        check_router_replay(ctx)
        return ctx.notes["router_replay"]

    for engine in ("torch", "continuous", "auto"):
        note = check(["model.path=/ckpt", f"rollout.engine={engine}"], model)
        assert note.endswith("engine records 2 MoE layers × top-8 of 64 experts")
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; Qwen2ForCausalLM has no router"):
        check(["model.path=/ckpt"], tc.model("qwen2"))
    with pytest.raises(ConfigError, match="the run trains the project's tiny dense Qwen2"):
        check([], None)
    with pytest.raises(ConfigError, match="the sglang engine records none .* set rollout.engine=torch"):
        check(["model.path=/ckpt", "rollout.engine=sglang", "rollout.server.url=http://127.0.0.1:30000"], model)
    assert load_config(None, []).algo.router_replay == "none"


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_replaying_a_models_own_routes_recomputes_its_own_gate_weights(name):
    """Each architecture's gating formula (router_replay.GATES): forced to the experts its own router
    chose, the model computes what it computes unforced (softmax-then-top-k with or without
    norm_topk_prob, DeepSeek-V3's sigmoid with its scaling, gpt-oss's softmax over the k logits);
    forced to other experts, something else."""
    from areal_core.rollout.route_recorder import RouteRecorder
    from tests.test_moe_lora import build

    m = build(name)
    seq = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RouteRecorder(m) as recorder:
        plain = m(input_ids=seq).logits
        own = recorder.take()
    shape = recorder.shape
    routes = own.view(2, 16, shape.layers, shape.top_k).to(torch.int16)
    with torch.no_grad(), RouteReplay(m, routes):
        replayed = m(input_ids=seq).logits
    with torch.no_grad(), RouteReplay(m, (routes + 1) % shape.experts):
        other = m(input_ids=seq).logits
    assert float((replayed - plain).abs().max()) < 1e-6
    assert float((other - plain).abs().max()) > 1e-4


def test_routes_of_more_than_254_experts_are_uint16():
    """DeepSeek-V3 has 256 experts: its ids are uint16 (65535: not recorded), read back as such, and
    the trainer's tensor is int16 with −1 where nothing was recorded."""
    from areal_core.routes import decode_routes, encode_routes, id_dtype

    assert id_dtype(254) == np.uint8 and id_dtype(255) == np.dtype("<u2")
    routes = np.array([[[255, 3]], [[65535, 65535]]], dtype="<u2")  # 2 tokens, 1 layer, k = 2
    assert np.array_equal(decode_routes(encode_routes(routes), 2), routes)
    s = Sample("s", "g", "p", "w", [1, 2], 1, [0, 1], [0.0, -1.0], [-1, 0], routes=routes)
    batch = collate([s, s], 0)
    assert batch.routes.dtype == torch.int16 and batch.routes[0].tolist() == [[[255, 3]], [[-1, -1]]]
