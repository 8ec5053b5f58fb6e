"""Bring your own model: for tiny random checkpoints of real transformers classes (benchmarks/tiny_checkpoints.py),
the trainer's forward (padded, packed, tree-packed), every built-in engine and the published weights
compute what the HF model computes, on rows longer than the attention window, full and LoRA; what
cannot be run exactly is refused at prepare, before any work."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from areal_core.architecture import attention_windows, linear_leaf_names
from areal_core.config import ConfigError
from areal_core.layout import LAYOUT
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.factory import local_engine_kind
from areal_core.rollout.static_cache import UnsupportedModel, check_supported
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train.logprobs import token_logprobs
from areal_core.train.lora import adapted_names, adapter_files, apply_lora, merge_adapter
from areal_core.train.packing import packed_token_logprobs
from areal_core.weights.adapter import ADAPTER_CONFIG
from benchmarks import tiny_checkpoints as tc
from tests.conftest import TINY

VOCAB = len(tc.tokenizer())  # the random tokens drawn: any id of the real tokenizer
TOL = 1e-5  # fp32, max |Δ log p| per token (measured ≤ 1e-6 on every architecture)
MOE = {"qwen3_moe", "qwen2_moe"}
ATTENTION_ONLY = "q_proj,k_proj,v_proj,o_proj"  # an MoE's LoRA targets when named by the user
CONTINUOUS = {
    "llama",
    "qwen2",
    "qwen2_untied",
    "qwen2_window",
    "qwen3",
    "mistral",
    "phi3",
    *MOE,
    "deepseek_v3",
    "gpt_oss",
}
WINDOWED = {"qwen2_window", "mistral", "gemma2", "gemma3", "phi3"}


@pytest.fixture(scope="module")
def tok():
    return tc.tokenizer()


def hf_logprobs(model, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log π(x_t | x_<t) for t ≥ 1 from the model's own forward over the one sequence (no padding, no mask)."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def lora_model(name: str, tok) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(PEFT model with non-zero adapters, the base model with the published adapter merged in:
    what every engine serves)."""
    base = tc.model(name, tok=tok)
    peft = apply_lora(copy.deepcopy(base), r=4, alpha=8)  # the default targets: MoE experts, Conv1D included
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    merge_adapter(base, adapter_files(peft))
    return peft.eval(), base.eval()


def rows(n_groups: int = 2, per_group: int = 3) -> tuple[list[list[int]], torch.Tensor]:
    """Groups sharing a 12-token prompt, with answers of 8-18 tokens: every row is longer than the window."""
    g = torch.Generator().manual_seed(0)
    seqs, groups = [], []
    for k in range(n_groups):
        prompt = torch.randint(3, VOCAB, (12,), generator=g).tolist()
        for j in range(per_group):
            seqs.append(prompt + torch.randint(3, VOCAB, (8 + 5 * j,), generator=g).tolist())
            groups.append(k)
    return seqs, torch.tensor(groups)


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), width, dtype=torch.long), torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", list(tc.ARCHS))
def test_the_trainer_forward_packed_or_not_equals_the_hf_forward_of_the_served_model(name, lora, tok):
    if lora:
        trained, served = lora_model(name, tok)
    else:
        trained = served = tc.model(name, tok=tok)
    seqs, groups = rows()
    assert max(map(len, seqs)) > 2 * tc.WINDOW
    ids, mask = padded(seqs)
    ref = [hf_logprobs(served, s, 0.7) for s in seqs]
    with torch.no_grad():
        paths = {
            "padded": token_logprobs(trained, ids, mask, 0.7),
            "packed": packed_token_logprobs(trained, ids, mask, 0.7, mode="position_ids"),
            "mask4d": packed_token_logprobs(trained, ids, mask, 0.7, mode="mask4d"),
            "tree": packed_token_logprobs(trained, ids, mask, 0.7, group_index=groups),
        }
    for path, lp in paths.items():
        gap = max(float((lp[i, 1 : len(s)] - ref[i]).abs().max()) for i, s in enumerate(seqs))
        assert gap < TOL, f"{name} {path}: max |Δ log p| {gap:.2e} against the HF forward"


def test_a_window_the_masks_dropped_would_show(tok):
    """The equality above is not vacuous: the same rows without the window differ from HF by far more than TOL."""
    model = tc.model("mistral", tok=tok)
    seqs, groups = rows()
    ids, mask = padded(seqs)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    with torch.no_grad():
        lp = packed_token_logprobs(unwindowed, ids, mask, group_index=groups)
    gap = max(float((lp[i, 1 : len(s)] - hf_logprobs(model, s)).abs().max()) for i, s in enumerate(seqs))
    assert gap > 1e-2


def engine_gap(engine, served, prompts: list[list[int]]) -> tuple[float, int]:
    """(max |Δ log p| of the engine's behaviour log-probs against the HF forward, tokens compared)."""
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))
    gap, n = 0.0, 0
    for p, g in zip(prompts, gens):
        ref = hf_logprobs(served, p + g.token_ids, 0.8)[len(p) - 1 :]
        gap = max(gap, float((ref - torch.tensor(g.logprobs)).abs().max()))
        n += len(g.token_ids)
    return gap, n


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", list(tc.ARCHS))
def test_every_builtin_engine_samples_with_the_log_probs_of_the_hf_forward(name, lora, tok):
    served = lora_model(name, tok)[1] if lora else tc.model(name, tok=tok)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 5, 9, 14)]
    engines = {"torch": lambda m: TorchEngine(m, tok.pad_token_id, tok.eos_token_id, seed=1)}
    if name in CONTINUOUS:
        engines["continuous"] = lambda m: ContinuousEngine(m, tok.pad_token_id, tok.eos_token_id, slots=3, seed=1)
        assert local_engine_kind("auto", served) == "continuous"
    else:
        with pytest.raises(UnsupportedModel, match="rollout.engine=torch"):
            check_supported(served)
        assert local_engine_kind("auto", served) == "torch"
    for kind, build in engines.items():
        gap, n = engine_gap(build(copy.deepcopy(served)), served, prompts)
        assert n > 4 * tc.WINDOW
        assert gap < TOL, f"{name} {kind} engine: max |Δ log p| {gap:.2e} against the HF forward"


@pytest.mark.parametrize("name", sorted(CONTINUOUS & WINDOWED))
def test_the_continuous_engine_keeps_the_window_across_a_weight_swap(name, tok):
    """A version installed mid-generation re-prefills under the new weights: the windowed and
    fused layers are re-read (`refresh`), and the tokens after the swap carry the new version."""
    old, new = tc.model(name, seed=0, tok=tok), tc.model(name, seed=3, tok=tok)
    engine = ContinuousEngine(copy.deepcopy(old), tok.pad_token_id, tok.eos_token_id, slots=2, seed=1)
    engine.load_version(1, {k: v.clone() for k, v in new.state_dict().items()})
    gap, _ = engine_gap(engine, new, [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    assert engine.version == 1 and gap < TOL


def test_phi3_lora_adapts_the_fused_projections_and_says_so():
    model = tc.model("phi3")
    peft = apply_lora(copy.deepcopy(model), r=4, alpha=8)
    adapted = adapted_names(peft)
    assert adapted == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    cfg = json.loads(adapter_files(peft)[ADAPTER_CONFIG])
    assert cfg["target_modules"] == adapted
    # r·(in + out) per adapted matrix, per layer: qkv 64→128, o 64→64, gate_up 64→256, down 128→64
    layers = model.config.num_hidden_layers
    assert sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n) == 4 * layers * (
        (64 + 128) + (64 + 64) + (64 + 256) + (128 + 64)
    )


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_lora_adapts_the_experts_and_what_the_user_names(name):
    model = tc.model(name)
    wrapped = apply_lora(copy.deepcopy(model))
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert any(".experts.lora_A" in n for n in trained)  # the routed experts (tests/test_moe_lora.py)
    assert adapted_names(apply_lora(copy.deepcopy(model), target_modules=ATTENTION_ONLY)) == sorted(
        ATTENTION_ONLY.split(",")
    )
    assert "gate" not in linear_leaf_names(model)  # the router is never a default LoRA target


def test_a_lora_target_the_model_lacks_is_named_with_what_it_has():
    from areal_core.architecture import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=r"\['qkv_proj'\].*\['down_proj', 'gate_proj'"):
        apply_lora(tc.model("llama"), target_modules="q_proj,qkv_proj")


def test_attention_windows_follow_the_config_as_transformers_reads_it():
    assert attention_windows(tc.config("mistral")) == [tc.WINDOW, tc.WINDOW]
    assert attention_windows(tc.config("qwen2_window")) == [None, tc.WINDOW]  # max_window_layers=1
    assert attention_windows(tc.config("gemma3")) == [tc.WINDOW, None]
    assert attention_windows(tc.config("qwen2")) == [None, None]
    cfg = tc.config("qwen2")
    cfg.layer_types = ["chunked_attention", "full_attention"]
    from areal_core.architecture import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="chunked_attention"):
        attention_windows(cfg)


# -- prepare refuses what it cannot run, before SFT and before writing anything -------------------

REFUSALS = {
    "gemma3 on the continuous engine": (
        "gemma3",
        True,
        ["rollout.engine=continuous"],
        r"preflight engine: config key 'rollout.engine'.*gemma3_text.*rollout.engine=torch",
    ),
    "a base model without a chat template": (
        "llama",
        False,
        [],
        r"preflight prompts: config key 'task.prompt_format'.*no chat template.*task.prompt_format=plain",
    ),
    "MoE LoRA on an expert weight the model lacks": (
        "qwen3_moe",
        True,
        ["train.lora_rank=4", "train.lora_target_modules=mlp.experts.up_proj"],
        r"preflight lora: config key 'train.lora_target_modules'.*mlp.experts.up_proj.*gate_up_proj",
    ),
    "a LoRA target the model lacks": (
        "phi3",
        True,
        ["train.lora_rank=4", "train.lora_target_modules=q_proj"],
        r"preflight lora: .*\['q_proj'\].*qkv_proj",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_prepare_refuses_before_any_work(case, tmp_path):
    name, template, overrides, message = REFUSALS[case]
    ckpt = tc.save(name, tmp_path / name, chat_template=template)
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        pipeline.prepare("", [*TINY, f"store={root}", f"model.path={ckpt}", *overrides])
    assert not root.exists() or not any(root.iterdir())  # nothing claimed, nothing written


def test_prepare_names_a_checkpoint_it_cannot_load(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(ConfigError, match=r"preflight model: config key 'model.path': cannot load"):
        pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}", f"model.path={bad}"])


def test_a_base_model_runs_with_plain_prompts(tmp_path):
    """The same template-less checkpoint passes prepare with task.prompt_format=plain, and its
    prompts are the plain text the config documents."""
    from areal_core.models import task_prompt

    ckpt = tc.save("llama", tmp_path / "llama", chat_template=False)
    run_uri, _ = pipeline.prepare(
        "", [*TINY, f"store={tmp_path / 'run'}", f"model.path={ckpt}", "task.prompt_format=plain"]
    )
    assert Store(run_uri).exists("config.yaml")
    tok = tc.tokenizer()
    assert tok.decode(task_prompt(tok, "2 + 3?", "Be brief.", "plain")) == "Be brief.\n\n2 + 3?\n"


# -- 3 synchronous steps through every role: the engine's behaviour log-probs equal the trainer's ----

PIPELINES = {
    "mistral-window-continuous": ("mistral", ["rollout.engine=continuous"]),
    "phi3-lora-auto": ("phi3", ["rollout.engine=auto", "train.lora_rank=4", "train.lr=1e-2"]),
    "gemma3-auto": ("gemma3", ["rollout.engine=auto"]),
    "qwen3-moe-torch": ("qwen3_moe", ["rollout.engine=torch"]),
    "qwen2-window-lora-continuous": ("qwen2_window", ["rollout.engine=continuous", "train.lora_rank=4"]),
    "qwen3-lora-auto": ("qwen3", ["rollout.engine=auto", "train.lora_rank=4"]),
}


def three_steps(ckpt, tmp_path, overrides: list[str]) -> Store:
    from areal_core.run.launcher import launch

    run_uri, _ = pipeline.prepare(
        "",
        [*TINY, f"store={tmp_path / 'run'}", f"model.path={ckpt}", "sft.enabled=false", "train.steps=3"]
        + ["train.eta=0", "rollout.max_new_tokens=12", "reward.function=tests.test_pipeline:hash_reward", *overrides],
    )
    pipeline.sft(run_uri)
    launch(run_uri, 1, 1, timeout_s=600, progress=False)
    store = Store(run_uri)
    assert store.done() and store.latest_version() == 3
    return store


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PIPELINES))
def test_three_synchronous_steps_train_the_model_the_engine_serves(case, tmp_path):
    name, overrides = PIPELINES[case]
    store = three_steps(tc.save(name, tmp_path / name), tmp_path, overrides)
    rows_ = [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line]
    assert [r["step"] for r in rows_] == [1, 2, 3]  # the version each step published
    # η = 0: every sample was drawn from the weights the trainer recomputes (π_behav = π_prox), so
    # the gap is the engine-vs-trainer difference alone, version after version
    assert max(r["abs_dlogp_behav_prox"] for r in rows_) < TOL
    assert all(r["grad_norm"] > 0 for r in rows_)  # hash_reward: mixed groups every step


def test_the_docs_table_is_what_the_code_does():
    """docs/architectures.md's table, regenerated from the checkpoints, is what is committed."""
    doc = tc.Path(__file__).resolve().parent.parent / "docs" / "architectures.md"
    text = doc.read_text()
    assert tc.docs_with_table(text) == text, "regenerate it: python -m benchmarks.tiny_checkpoints --docs"
    assert "| phi3 | `Phi3ForCausalLM` | continuous, torch | down_proj, gate_up_proj, o_proj, qkv_proj | 8/8 |" in text


@pytest.mark.slow
def test_a_bfloat16_checkpoint_in_shards_stays_bfloat16_on_disk(tmp_path):
    """A user's bf16 checkpoint in 2 safetensors shards: init_model is its exact bf16 weights and
    final_model is written in bf16 too (the trainer's master weights stay float32 in between)."""
    from safetensors import safe_open

    model = tc.model("llama").to(torch.bfloat16)
    ckpt = tmp_path / "bf16"
    model.save_pretrained(ckpt, max_shard_size="200KB")
    tc.tokenizer().save_pretrained(ckpt)
    assert len(list(ckpt.glob("model-*.safetensors"))) >= 2
    store = three_steps(ckpt, tmp_path, ["rollout.engine=auto"])
    for folder in (LAYOUT.init_model, LAYOUT.final_model):
        local = store.local_path(folder)
        assert json.loads((local / "config.json").read_text())["dtype"] == "bfloat16"
        for f in local.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
    from areal_core.models import load_pretrained

    reloaded, _ = load_pretrained(str(store.local_path(LAYOUT.init_model)))
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v.float()), k


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_large_checkpoint_is_checked_without_its_weights(where, tmp_path, monkeypatch, request):
    """Over MAX_WEIGHT_BYTES, prepare builds the model on the meta device from its config (no
    model-sized memory on prepare's pod, no weight download from a remote store): the engine and
    LoRA checks still refuse, and the agreement check says it was skipped."""
    from areal_core.run import preflight

    monkeypatch.setattr(preflight, "MAX_WEIGHT_BYTES", 0)
    local = tc.save("gemma3", tmp_path / "gemma3")
    path = str(local)
    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        Store(f"{bucket}/gemma3").put_dir(str(local), "")
        path = f"{bucket}/gemma3"
    with pytest.raises(ConfigError, match=r"preflight engine: .*gemma3_text"):
        pipeline.prepare("", [*TINY, f"store={tmp_path / 'r1'}", f"model.path={path}", "rollout.engine=continuous"])
    cfg_overrides = [*TINY, f"store={tmp_path / 'r2'}", f"model.path={path}", "train.lora_rank=4"]
    from areal_core.config import load_config
    from task_data import load_task

    cfg = load_config(None, cfg_overrides)
    notes = preflight.run_preflight(cfg, load_task(cfg.task, cfg.seed)[0])
    assert notes["agreement"].startswith("skipped: weights over 0 GiB") and "q_proj" in notes["lora"]


# GPT-2 aside: LogitHead's first-use check declines it on these rows (not looked into), so it computes whole logits
@pytest.mark.parametrize("name", [n for n in tc.ARCHS if n != "gpt2"])
def test_log_probs_from_the_head_in_chunks_equal_the_full_logits_value_and_gradient(name, tok):
    """train/head.py: every path (padded, packed, tree) with the LM head applied 7 tokens at a time
    gives the full-logits log-probs and entropy, and the same gradient, to 1e-6 (float32);
    Gemma's soft-capping and Granite's logit scaling included."""
    from areal_core.train import head as chunked

    seqs, groups = rows()
    ids, mask = padded(seqs)
    model = tc.model(name, tok=tok).train()
    assert chunked.LogitHead.for_model(model, ids, 7) is not None  # the first-use check agreed
    paths = {
        "padded": lambda c: token_logprobs(model, ids, mask, 0.7, with_entropy=True, logit_chunk=c),
        "packed": lambda c: packed_token_logprobs(model, ids, mask, 0.7, with_entropy=True, logit_chunk=c),
        "tree": lambda c: packed_token_logprobs(
            model, ids, mask, 0.7, with_entropy=True, group_index=groups, logit_chunk=c
        ),
    }
    for path, run in paths.items():
        results = []
        for c in (0, 7):
            model.zero_grad()
            lp, ent = run(c)
            ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results.append((lp.detach(), ent.detach(), grads))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        assert (lp0 - lp1).abs().max() < 1e-6 and (ent0 - ent1).abs().max() < 1e-5, (name, path)
        assert (g0 - g1).abs().max() < 1e-5 * max(1.0, float(g0.abs().max())), (name, path)


def test_a_head_whose_post_processing_is_unknown_falls_back_to_full_logits(tok, caplog):
    """A CausalLM that changes its logits in a way head.py does not reproduce is caught by the
    first-use comparison and keeps the full-logits path (with a warning), never a wrong value."""
    from areal_core.train import head as chunked

    model = tc.model("llama", tok=tok)
    original = type(model).forward

    class Doubled(type(model)):
        def forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            out.logits = out.logits * 2
            return out

    model.__class__ = Doubled
    ids, _ = padded(rows()[0])
    assert chunked.LogitHead.for_model(model, ids, 7) is None
    assert "using full logits" in caplog.text


@pytest.mark.slow
def test_a_real_vocabulary_fits_in_chunked_memory_where_full_logits_do_not():
    """benchmarks/logit_memory.py at Qwen2.5's 151,936 rows, 2,048 tokens, with gradients: the
    head in chunks of 512 adds under 2.5 GB; full logits add more than 4 GB (fresh processes)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "benchmarks/logit_memory.py", "--rows", "4", "--tokens", "512", "--chunks", "512", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    chunked, full = (json.loads(line) for line in out.stdout.splitlines())
    assert chunked["chunk"] == 512 and chunked["added_mb"] < 2500, chunked
    assert full["chunk"] == 0 and full["added_mb"] > 4000, full


def test_gradient_checkpointing_with_the_chunked_head_gives_the_same_gradient(tok):
    from areal_core.train.lora import is_gradient_checkpointing, set_gradient_checkpointing

    seqs, groups = rows()
    ids, mask = padded(seqs)
    grads = []
    for enabled in (False, True):
        model = tc.model("qwen2_window", tok=tok).train()
        set_gradient_checkpointing(model, enabled)
        assert is_gradient_checkpointing(model) == enabled
        lp = packed_token_logprobs(model, ids, mask, group_index=groups, logit_chunk=16)
        (lp * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max() < 1e-5


def test_the_trainer_chunks_the_head_only_where_the_logits_are_large(tok, monkeypatch):
    """Small logits (the embedded task: tokens × 384) run all at once, which is faster; past
    FULL_LOGITS_MAX values the configured chunk applies. Both give the same log-probs."""
    from types import SimpleNamespace

    from areal_core.config import load_config
    from areal_core.train import step

    seqs, groups = rows()
    ids, mask = padded(seqs)
    batch = SimpleNamespace(input_ids=ids, attention_mask=mask, group_index=groups)
    cfg = load_config(None, [])
    model = tc.model("qwen2", tok=tok)
    seen = []
    real = step.packed_token_logprobs
    monkeypatch.setattr(step, "packed_token_logprobs", lambda *a, **k: seen.append(k["logit_chunk"]) or real(*a, **k))
    with torch.no_grad():
        small = step.policy_logprobs(model, batch, None, cfg, pad_id=0)
        monkeypatch.setattr(step, "FULL_LOGITS_MAX", 0)
        large = step.policy_logprobs(model, batch, None, cfg, pad_id=0)
    assert seen == [0, cfg.train.logit_chunk_tokens] and (small - large).abs().max() < 1e-6
