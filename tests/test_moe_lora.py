"""LoRA on mixture-of-experts and GPT-2 (issue 55): the default targets reach the routed experts
(peft's target_parameters on transformers' fused 3D expert weights) and GPT-2's Conv1D layers; the
published adapter names what was adapted, and every consumer's merge of it computes what peft
computes. Through the run path: 3 synchronous GRPO steps, the engine's behaviour log-probs equal a
float32 HF forward of the adapted model (peft reading the published adapter), the expert adapters
train, and the merged checkpoint vLLM would load is that model too."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from areal_core.architecture import LORA_TARGETS, UnsupportedArchitecture, expert_parameters, lora_targets
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.train.lora import adapter_files, apply_lora, merge_adapter
from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_target
from areal_core.weights.reader import read_manifest, read_version_file, stage_verified
from benchmarks import tiny_checkpoints as tc
from tests.test_architectures import three_steps

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE = ["qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
TOL = 1e-5
# the two classes the run test leaves out, built here only for the merge check
EXTRA = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v2": (
        "DeepseekV2Config",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
        | {"n_shared_experts": 1, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
        | {"qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4},
    ),
}


def build(name: str) -> torch.nn.Module:
    if name in tc.ARCHS:
        return tc.model(name)
    cls, extra = EXTRA[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(vocab_size=300, **(tc._BASE | extra))
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def logits(model, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=seq).logits


@pytest.mark.parametrize("name", [*MOE, "gpt2", *EXTRA])
def test_the_merged_model_computes_what_the_peft_model_computes(name):
    """Every adapted weight, the experts' per-expert blocks in either layout (gpt-oss stores them
    [experts, in, out]; Qwen3-MoE's gate_up_proj is square here, so only the published layout tells
    them apart), merged from the published files alone."""
    base = build(name)
    peft = apply_lora(copy.deepcopy(base), r=4, alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    files = adapter_files(peft)
    merged = copy.deepcopy(base)
    merge_adapter(merged, files)
    vocab = base.get_output_embeddings().weight.shape[0]
    seq = torch.randint(3, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = logits(peft, seq)
    assert float((logits(base, seq) - ref).abs().max()) > 0.1  # the adapter matters
    assert float((logits(merged, seq) - ref).abs().max()) < TOL
    cfg = json.loads(files[ADAPTER_CONFIG])
    if name == "gpt2":
        assert cfg["target_modules"] == ["c_attn", "c_fc", "c_proj"] and cfg["fan_in_fan_out"] is True
    else:
        assert [t for t in cfg["target_parameters"] if t in EXPERTS] == EXPERTS  # innermost first, as vLLM reads
        layout = "[experts, in, out]" if name == "gpt_oss" else "[experts, out, in]"
        assert {cfg["parameter_layouts"][e] for e in EXPERTS} == {layout}


def test_the_registry_names_every_expert_weight_and_leaves_routers_frozen():
    for name in [*MOE, *EXTRA]:
        model = build(name)
        targets = lora_targets(model)
        assert model.config.model_type in LORA_TARGETS
        assert list(targets.parameters) == expert_parameters(model) == EXPERTS
        assert not {"gate", "router", "shared_expert_gate"} & set(targets.modules)
    mla = lora_targets(build("deepseek_v3")).modules
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj"} <= set(mla)
    assert lora_targets(build("deepseek_v2")).modules[0] == "q_proj"  # q_lora_rank None: no q_a/q_b
    assert lora_targets(build("gpt2")).modules == ("c_attn", "c_proj", "c_fc")


def test_a_router_is_adapted_only_when_named():
    model = build("qwen3_moe")
    peft = apply_lora(copy.deepcopy(model), r=2, target_modules="q_proj,mlp.gate.weight")
    adapted = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert any(".mlp.gate.lora_A" in n for n in adapted) and not any("experts" in n for n in adapted)
    with pytest.raises(UnsupportedArchitecture, match=r"\['mlp.experts.up_proj'\].*gate_up_proj"):
        apply_lora(copy.deepcopy(model), target_modules="mlp.experts.up_proj")


def test_the_nesting_rule_reads_inner_wrappers_as_the_earlier_targets():
    order = [*EXPERTS, "mlp.shared_expert.gate_proj.weight"]
    assert adapter_target("model.layers.1.mlp.experts", order, False)[0] == "model.layers.1.mlp.experts.down_proj"
    assert adapter_target("model.layers.1.mlp.experts.base_layer", order, False) == (
        "model.layers.1.mlp.experts.gate_up_proj",
        EXPERTS[0],
    )
    assert adapter_target("model.layers.0.mlp.shared_expert.gate_proj", order, False)[1] == order[2]
    assert adapter_target("transformer.h.0.attn.c_attn", [], True) == (
        "transformer.h.0.attn.c_attn.weight",
        "[in, out]",
    )


# -- through the run path -------------------------------------------------------------------------


def adapter_of(store, version: int) -> dict[str, bytes]:
    manifest = read_manifest(store, version)
    return {n: read_version_file(store, version, manifest, n) for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}


def peft_reading(store, version: int, tmp_path) -> torch.nn.Module:
    """The adapted model as peft builds it from the published files (not the project's merge)."""
    from peft import PeftModel

    from areal_core.models import load_pretrained

    folder = tmp_path / f"adapter-v{version}"
    folder.mkdir(exist_ok=True)
    for name, data in adapter_of(store, version).items():
        (folder / name).write_bytes(data)
    base = load_pretrained(store.url(LAYOUT.init_model))[0]
    return PeftModel.from_pretrained(base, str(folder)).eval()


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log π(x_t | x_<t) for t ≥ 1, float32, one unpadded row."""
    seq = torch.tensor([ids])
    return torch.log_softmax(logits(model, seq)[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*MOE, "gpt2"])
def test_three_lora_steps_serve_the_adapted_model(name, tmp_path):
    store = three_steps(
        tc.save(name, tmp_path / name), tmp_path, ["rollout.engine=auto", "train.lora_rank=4", "train.lr=1e-2"]
    )
    cfg = json.loads(adapter_of(store, 3)[ADAPTER_CONFIG])
    if name == "gpt2":
        assert cfg["target_modules"] == ["c_attn", "c_fc", "c_proj"] and cfg["fan_in_fan_out"] is True
    else:
        assert [t for t in cfg["target_parameters"] if t in EXPERTS] == EXPERTS
    # the adapters train: the experts' (every Conv1D's for GPT-2) change from version 1 to 3
    first, last = (decode_tensors(adapter_of(store, v)[ADAPTER_WEIGHTS]) for v in (1, 3))
    trained = [k for k in last if ("experts" in k or name == "gpt2") and "lora_B" in k]
    assert trained and all(float((last[k] - first[k]).abs().max()) > 0 for k in trained)
    # the behaviour log-probs the engine stored are those of peft's model of the version that drew them
    samples = [s for p in store.find(LAYOUT.graded_dir, ".arrow") for s in decode_shard(store.read_bytes(p))]
    models: dict[int, torch.nn.Module] = {}
    gaps = []
    for s in samples:
        version = s.versions[s.prompt_len]
        if version not in models:
            models[version] = peft_reading(store, version, tmp_path) if version else tc.model(name)
        ref = token_logprobs(models[version], s.input_ids)[s.prompt_len - 1 :]
        gaps.append((ref - torch.tensor(s.behav_logprobs[s.prompt_len :])).abs())
    assert len({v for v in models}) >= 2  # more than the base served
    assert float(torch.cat(gaps).mean()) < TOL and float(torch.cat(gaps).max()) < 1e-4
    # vLLM's merged path: the whole checkpoint staged for a server is that model too
    staged = stage_verified(store, 3, tmp_path / "staged")
    served = transformers.AutoModelForCausalLM.from_pretrained(staged, dtype=torch.float32).eval()
    seq = torch.tensor([samples[0].input_ids])
    assert (
        float((logits(served, seq) - logits(models.get(3) or peft_reading(store, 3, tmp_path), seq)).abs().max()) < TOL
    )


def decode_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


@pytest.mark.parametrize(("model_type", "native"), [("qwen3_moe", False), ("gpt_oss", False), ("llama", True)])
def test_vllm_serves_an_expert_adapter_merged_unless_told_native(model_type, native, tmp_path):
    """On a GPU `rollout.server.lora=auto` is native LoRA, but not for an MoE whose adapter holds
    fused expert weights (docs/vllm.md: vLLM's native reading of those is per class, untested here)."""
    from areal_core.config import load_config
    from areal_core.rollout.factory import vllm_native_lora
    from areal_core.store import Store

    store = Store(str(tmp_path))
    store.write_json(LAYOUT.init_config, {"model_type": model_type})
    run = ["rollout.engine=vllm", "rollout.server.url=http://127.0.0.1:9", "train.lora_rank=8", "device=cuda"]
    assert vllm_native_lora(load_config(None, run), store) is native
    assert vllm_native_lora(load_config(None, [*run, "rollout.server.lora=native"]), store) is True
