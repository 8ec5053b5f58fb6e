"""Issue 44: packed rows attend per span without an [L, L] mask (train/segment_attention.py), and a
minibatch runs as micro-batches under a token budget with its gradient accumulated
(train/micro_batches.py). Both are checked against the HF forward of real architectures
(benchmarks/tiny_checkpoints.py) and against the step without them."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from areal_core.config import ConfigError, load_config
from areal_core.run import pipeline
from areal_core.train import packing
from areal_core.train.micro_batches import combine, split_rows
from areal_core.train.packing import packed_token_logprobs, segments_agree
from areal_core.train.segment_attention import SpanPlan, use_segments
from benchmarks import tiny_checkpoints as tc
from tests.conftest import ROOT, TINY
from tests.test_architectures import TOL, hf_logprobs, lora_model, padded, rows
from tests.test_config_misuse import SMALL

# run eager attention, which per-span attention refuses: stay on masks (refusal asserted below)
EAGER = {"gemma2": "Gemma2ForCausalLM", "gpt_oss": "GptOssForCausalLM"}  # logit soft-capping; attention sinks


@pytest.fixture(scope="module")
def tok():
    return tc.tokenizer()


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", sorted(set(tc.ARCHS) - set(EAGER)))
def test_per_span_attention_equals_the_hf_forward_and_the_masks_gradient(name, tok):
    """Tree rows (a group's prompt once) and packed rows, per span: log-probs equal to the HF forward
    of each sequence alone to 1e-5 and gradients equal to the 4D-mask path's, on rows longer than
    every window (so a dropped window or a leak across sequences would show)."""
    seqs, groups = rows()
    ids, mask = padded(seqs)
    model = tc.model(name, tok=tok).train()
    ref = [hf_logprobs(model, s, 0.7) for s in seqs]
    for kwargs in ({"group_index": groups}, {}):
        results = {}
        for attention in ("mask", "segments"):
            model.zero_grad()
            lp = packed_token_logprobs(model, ids, mask, 0.7, attention=attention, **kwargs)
            (lp * mask).sum().backward()
            results[attention] = (lp.detach(), grads(model))
        lp, g = results["segments"]
        gap = max(float((lp[i, 1 : len(s)] - ref[i]).abs().max()) for i, s in enumerate(seqs))
        assert gap < TOL, (name, kwargs, gap)
        g0 = results["mask"][1]
        assert (g - g0).abs().max() < 1e-5 * max(1.0, float(g0.abs().max())), (name, kwargs)
    assert model.config._attn_implementation == "areal_segments"


@pytest.mark.parametrize("name", sorted(EAGER))
def test_per_span_attention_is_refused_by_name_for_eager_architectures(name, tok):
    seqs, groups = rows()
    ids, mask = padded(seqs)
    model = tc.model(name, tok=tok)
    with pytest.raises(ValueError, match=f"{EAGER[name]} cannot attend per span .*eager"):
        packed_token_logprobs(model, ids, mask, group_index=groups, attention="segments")


def test_dropout_does_not_keep_a_model_off_per_span_attention(tok):
    """The first-use check compares in eval mode: GPT-2 as its checkpoints ship (dropout 0.1) in
    train mode attends per span, and is left in train mode."""
    from transformers import AutoModelForCausalLM

    cfg = tc.config("gpt2", tok)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.1
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids, _ = padded(rows()[0])
    assert use_segments(model) and segments_agree(model, ids) and model.training


@pytest.mark.parametrize("name", ["qwen2_window", "phi3", "qwen3_moe"])
def test_per_span_attention_with_lora_equals_the_served_model(name, tok):
    trained, served = lora_model(name, tok)
    seqs, groups = rows()
    ids, mask = padded(seqs)
    with torch.no_grad():
        lp = packed_token_logprobs(trained, ids, mask, 0.7, group_index=groups, attention="segments")
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(served, s, 0.7)).abs().max()) for i, s in enumerate(seqs))
    assert gap < TOL


def test_a_window_dropped_per_span_would_show(tok):
    """The equality above is not vacuous: the same spans without their window differ from HF."""
    model = tc.model("mistral", tok=tok)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    seqs, groups = rows()
    ids, mask = padded(seqs)
    with torch.no_grad():
        lp = packed_token_logprobs(unwindowed, ids, mask, group_index=groups, attention="segments")
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(model, s)).abs().max()) for i, s in enumerate(seqs))
    assert gap > 1e-2


def test_a_model_that_cannot_attend_per_span_is_named_or_kept_on_masks(tok, caplog, monkeypatch):
    """Gemma 2 runs eager attention (soft-capped logits): `segments` is refused by name, `auto`
    keeps its masks. A model whose span attention would differ from its masks (here: Mistral with
    its window misread, as an unknown architecture's could be) is caught by the first-use check and
    kept on masks, its values still exact."""
    import areal_core.train.segment_attention as sa

    seqs, groups = rows()
    ids, mask = padded(seqs)
    gemma = tc.model("gemma2", tok=tok)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM cannot attend per span .*eager"):
        packed_token_logprobs(gemma, ids, mask, group_index=groups, attention="segments")
    model = tc.model("mistral", tok=tok)
    monkeypatch.setattr(sa, "attention_windows", lambda config: [None] * config.num_hidden_layers)
    monkeypatch.setattr(packing, "MAX_MASK_ROW", 4)  # every row is "long": auto asks for segments
    with caplog.at_level(logging.WARNING, "areal.train"), torch.no_grad():
        lp = packed_token_logprobs(model, ids, mask, group_index=groups)
    assert "segment attention differs from 4D masks" in caplog.text
    assert use_segments(model) and not segments_agree(model, ids)  # remembered per model
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(model, s)).abs().max()) for i, s in enumerate(seqs))
    assert gap < TOL


def test_segments_for_a_model_that_cannot_is_refused_at_prepare(tmp_path):
    ckpt = tc.save("gemma2", tmp_path / "gemma2")
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"preflight attention: .*Gemma2ForCausalLM runs eager"):
        pipeline.prepare("", [*TINY, f"store={root}", f"model.path={ckpt}", "train.packed_attention=segments"])
    assert not root.exists() or not any(root.iterdir())
    ckpt = tc.save("qwen2_window", tmp_path / "qwen2")  # an sdpa model: prepared
    pipeline.prepare("", [*TINY, f"store={root}", f"model.path={ckpt}", "train.packed_attention=segments"])


def test_auto_keeps_long_groups_as_trees_per_span(tok, monkeypatch):
    """Past MAX_MASK_ROW tokens a group's tree row used to fall back to one row per sequence (its
    prompt recomputed per member); per span it stays one tree row, and equals the HF forward."""
    seen = []
    original = packing.tree_token_logprobs

    def spy(model, tree, *args):
        seen.append((tree.input_ids.shape[1], args[-1]))
        return original(model, tree, *args)

    monkeypatch.setattr(packing, "tree_token_logprobs", spy)
    monkeypatch.setattr(packing, "MAX_MASK_ROW", 40)
    monkeypatch.setattr(packing, "MAX_TREE_ROW", 40)
    seqs, groups = rows()
    ids, mask = padded(seqs)
    model = tc.model("qwen2", tok=tok)
    with torch.no_grad():
        lp = packed_token_logprobs(model, ids, mask, group_index=groups)
        masked = packed_token_logprobs(model, ids, mask, group_index=groups, attention="mask")
    assert seen == [(12 + 8 + 13 + 18, True)]  # one tree row of the 2 groups' widest, per span
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(model, s)).abs().max()) for i, s in enumerate(seqs))
    assert gap < TOL and (lp - masked).abs().max() < TOL


def test_auto_runs_plain_rows_when_the_tree_saves_little(tok, monkeypatch):
    """A long group whose prompt is a small share of its tokens (2 of 40 per answer) runs as plain
    rows: sharing the prompt would save under MIN_TREE_SAVING of the work."""
    calls = []
    monkeypatch.setattr(packing, "tree_token_logprobs", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(packing, "MAX_MASK_ROW", 40)
    monkeypatch.setattr(packing, "MAX_TREE_ROW", 40)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 200, (2,), generator=g).tolist()
    seqs = [prompt + torch.randint(3, 200, (38,), generator=g).tolist() for _ in range(3)]
    ids, mask = padded(seqs)
    model = tc.model("qwen2", tok=tok)
    with torch.no_grad():
        lp = packed_token_logprobs(model, ids, mask, group_index=torch.zeros(3, dtype=torch.long))
    assert calls == []
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(model, s)).abs().max()) for i, s in enumerate(seqs))
    assert gap < TOL


def test_span_plans_read_from_segment_ids():
    seg = torch.tensor([[-2, -2, 0, 0, 1, -1], [3, 3, 4, -1, -1, -1]])
    assert SpanPlan.from_segments(seg, -2).rows == (
        ((0, 2, 0, 0), (2, 2, 0, 2), (4, 1, 0, 2)),
        ((0, 2, 0, 0), (2, 1, 0, 0)),
    )
    assert SpanPlan.from_segments(seg[1:]).rows == (((0, 2, 0, 0), (2, 1, 0, 0)),)


@pytest.mark.slow
def test_a_long_shared_prompt_per_span_costs_less_memory_than_masks():
    """benchmarks/scale.py's attention case in fresh processes: a group of 8 answers of 256 tokens
    under one 2,048-token prompt, with gradients. Per span the prompt is computed once; the masked
    path runs 8 rows of 2,304 tokens. The span path adds less than 70% of the masked path's memory."""
    added = {}
    for attention in ("segments", "mask"):
        out = subprocess.run(
            [sys.executable, "benchmarks/scale.py", "attention", "--attention", attention, "--prompt", "2048"]
            + ["--answer", "256", "--rows", "8", "--vocab", "1000"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        added[attention] = json.loads(out.stdout.splitlines()[-1])["added_mb"]
    assert added["mask"] > 100, added  # the masked path's extra memory is measured, not read as 0
    assert added["segments"] < 0.7 * added["mask"], added


# -- micro-batches -------------------------------------------------------------------------------


def test_micro_batches_keep_groups_whole_and_split_only_what_cannot_fit():
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    lengths = torch.tensor([10, 10, 10, 5, 5, 40, 3, 3])
    rows_ = torch.arange(8)
    assert [m.tolist() for m in split_rows(rows_, groups, lengths, 0)] == [list(range(8))]
    parts = [m.tolist() for m in split_rows(rows_, groups, lengths, 30)]
    assert parts == [[0, 1, 2], [3, 4], [5], [6, 7]]  # group 2 (46 tokens) is cut; row 5 alone is over
    assert sorted(sum(parts, [])) == list(range(8))
    for budget in (1, 7, 13, 25, 60, 100):
        parts = split_rows(rows_, groups, lengths, budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(8))
        for m in parts:
            assert int(lengths[m].sum()) <= budget or len(m) == 1 or len(set(groups[m].tolist())) == 1
    assert combine(
        [({"loss": 1.0, "clip_frac": 0.5, "policy_tokens": 3}, 3), ({"loss": 2.0, "clip_frac": 0.0}, 1)]
    ) == {
        "loss": 3.0,
        "clip_frac": 0.375,
        "policy_tokens": 3,
    }


@pytest.mark.parametrize(
    "algo",
    [
        [],
        ["algo.loss=gspo", "algo.aggregation=seq_mean_token_mean", "algo.behav_level=geometric"],
        ["algo.adv_estimator=dr_grpo", "algo.aggregation=seq_mean_token_sum_norm"],
        ["algo.entropy_coef=0.01", "algo.kl_coef=0.05"],
    ],
    ids=["grpo", "gspo", "dr_grpo", "entropy_kl"],
)
@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_step_in_micro_batches_equals_the_step_at_once(algo, minibatches):
    """Loss, metrics and the updated parameters of a step run as micro-batches of ≤ 16 tokens equal
    the step at once (groups of ~40 tokens: cut into runs of rows)."""
    from areal_core.train.step import train_step
    from tests.test_fsdp import MODEL, fixed_batches, make_model, make_optimizer

    base = [*MODEL, *algo, f"train.ppo_minibatches={minibatches}", "train.batch_groups=2", "train.lr=3e-3"]
    results = []
    # one intra-op thread: on two, a reduction's order follows how rows split between threads, which differs
    # between the whole batch and its micro-batches; Adam turned that float32 noise into one element 1.7e-5 apart
    # (dr_grpo, 2 minibatches, AMD EPYC), so the comparison measured the thread split, not micro-batching
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for budget in (0, 16):
            cfg = load_config(None, [*base, f"train.max_tokens_per_micro_batch={budget}"])
            model = make_model(cfg)
            ref = make_model(cfg) if cfg.algo.kl_coef else None
            opt = make_optimizer(model, cfg)
            stats = [train_step(model, opt, b, cfg, 0, ref_model=ref) for b in fixed_batches()[:2]]
            results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}))
    finally:
        torch.set_num_threads(threads)
    (whole, sd0), (micro, sd1) = results
    assert all(s["micro_batches"] > 1 for s in micro) and all(s["micro_batches"] == 1 for s in whole)
    for a, b in zip(whole, micro):
        for key in ("loss", "grad_norm", "clip_frac", "response_tokens", "policy_tokens"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for k, v in sd0.items():
        torch.testing.assert_close(sd1[k], v, rtol=1e-4, atol=1e-5)  # as two FSDP ranks (test_fsdp.py)


@pytest.mark.parametrize("loss", ["dpo", "m2po"])
def test_a_loss_that_needs_every_row_is_refused_micro_batches_at_prepare(tmp_path, loss):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"{loss} cannot run in micro-batches"):
        pipeline.prepare(
            "", [*TINY, *SMALL, f"store={root}", "train.max_tokens_per_micro_batch=64", f"algo.loss={loss}"]
        )
    assert not root.exists() or not any(root.iterdir())
