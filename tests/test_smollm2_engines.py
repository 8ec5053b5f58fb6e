"""Real architectures in the rollout engines: Llama (tied and untied, with and without biases),
an architecture the packed decoder does not implement, and the real SmolLM2-135M-Instruct
(a Llama with tied embeddings and a 49k vocabulary) against HF `generate`; LoRA adapters
published by the trainer and loaded by the built-in engines.

The SmolLM2 folder comes from the `smollm2_path` fixture (areal_core.pretrained, cached).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from areal_core.models import chat_prompt
from areal_core.rollout.continuous_engine import ContinuousEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.static_cache import UnsupportedModel
from areal_core.rollout.torch_engine import TorchEngine

PAD, EOS, VOCAB = 0, 1, 97


def tiny_llama(tied: bool, bias: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,  # head_dim 8, 3 query heads per kv head
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        rope_theta=100000.0,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make every term count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def prompts(lengths=(3, 9, 5, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], n: int, eos: int = EOS, pad: int = PAD) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tied,bias", [(False, False), (False, True), (True, True)])
def test_llama_greedy_equals_transformers_generate(tied, bias):
    model = tiny_llama(tied, bias)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    params = SamplingParams(max_new_tokens=16, greedy=True)
    refs = [hf_greedy(model, p, 16) for p in prompts()]
    assert len({tuple(r) for r in refs}) > 1  # not a degenerate model
    for engine in (TorchEngine(model, PAD, EOS), ContinuousEngine(model, PAD, EOS, slots=3)):
        gens = engine.generate(prompts(), params)
        assert [g.token_ids for g in gens] == refs, type(engine).__name__


def test_untied_llama_swap_reads_the_new_lm_head():
    """A swap that changes only lm_head (untied) changes what the packed decoder samples."""
    model = tiny_llama(tied=False, bias=False)
    other = tiny_llama(tied=False, bias=False, seed=5)
    engine = ContinuousEngine(model, PAD, EOS, slots=4)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    before = [g.token_ids for g in engine.generate(prompts(), params)]
    engine.load_version(1, {"lm_head.weight": other.lm_head.weight.detach().clone()})
    after = [g.token_ids for g in engine.generate(prompts(), params)]
    assert after != before
    assert after == [hf_greedy(model, p, 8) for p in prompts()]  # the model now holds the new head


def test_unsupported_architecture_is_named_and_the_torch_engine_serves_it():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=EOS, eos_token_id=EOS)
    ).eval()
    with pytest.raises(UnsupportedModel, match=r"'gpt2'.*GPT2LMHeadModel.*rollout.engine=torch"):
        ContinuousEngine(gpt2, PAD, EOS)
    gens = TorchEngine(gpt2, PAD, EOS).generate(prompts(), SamplingParams(max_new_tokens=10, greedy=True))
    assert [g.token_ids for g in gens] == [hf_greedy(gpt2, p, 10) for p in prompts()]


# -- the real model ---------------------------------------------------------------------------------
QUESTIONS = ["What is 12 + 35?", "Tom has 7 apples and buys 5 more. How many apples does he have now?"]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, tok


def chat_prompts(tok) -> list[list[int]]:
    return [chat_prompt(tok, q) for q in QUESTIONS]


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_generate(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    ps = chat_prompts(tok)
    n = 24
    refs = [hf_greedy(model, p, n, tok.eos_token_id, tok.pad_token_id) for p in ps]
    assert all(len(r) > 5 for r in refs)
    params = SamplingParams(max_new_tokens=n, greedy=True)
    for engine in (
        TorchEngine(model, tok.pad_token_id, tok.eos_token_id),
        ContinuousEngine(model, tok.pad_token_id, tok.eos_token_id, slots=2),
    ):
        gens = engine.generate(ps, params)
        assert [g.token_ids for g in gens] == refs, type(engine).__name__


# -- LoRA versions ---------------------------------------------------------------------------------
def lora_store(tmp_path, model):
    """A store holding `model` as init_model, and a LoRA-wrapped copy with non-zero adapters."""
    import copy

    from areal_core.layout import LAYOUT
    from areal_core.store import Store
    from areal_core.train.lora import apply_lora

    store = Store(str(tmp_path / "run"))
    model.save_pretrained(tmp_path / "init")
    store.put_dir(str(tmp_path / "init"), LAYOUT.init_model)
    store.write_json(LAYOUT.committed(LAYOUT.init_model), {})
    peft = apply_lora(copy.deepcopy(model), r=4, alpha=8)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return store, peft


@pytest.mark.parametrize("engine_cls", [TorchEngine, ContinuousEngine])
def test_a_published_adapter_is_merged_into_the_engines_base(tmp_path, engine_cls):
    from areal_core.train.lora import adapter_files, merged_state_dict
    from areal_core.weights.publisher import WeightPublisher, state_dict_bytes

    model = tiny_llama(tied=False, bias=False)
    store, peft = lora_store(tmp_path, model)
    publisher = WeightPublisher(store, {"config.json": b"{}"})
    publisher.publish_adapter(1, adapter_files(peft))
    assert "model.safetensors" not in store.read_json("weights/v000001/MANIFEST.json")["files"]
    assert publisher.last_weights_bytes < len(state_dict_bytes(model)) / 3
    merged_model = tiny_llama(tied=False, bias=False)
    merged_model.load_state_dict(merged_state_dict(peft))
    params = SamplingParams(max_new_tokens=12, greedy=True)
    refs = [hf_greedy(merged_model, p, 12) for p in prompts()]
    engine = engine_cls(model, PAD, EOS)
    before = [g.token_ids for g in engine.generate(prompts(), params)]
    assert before != refs  # the adapter changes the greedy answers
    engine.receive(store, 1)
    assert [g.token_ids for g in engine.generate(prompts(), params)] == refs
    assert engine.version == 1


def test_an_adapter_version_stages_as_a_whole_merged_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from areal_core.train.lora import adapter_files, merged_state_dict
    from areal_core.weights import WeightsError
    from areal_core.weights.publisher import WeightPublisher
    from areal_core.weights.reader import stage_verified

    store, peft = lora_store(tmp_path, tiny_llama(tied=True, bias=False))
    publisher = WeightPublisher(store, {"config.json": b"{}"})
    files = adapter_files(peft)
    publisher.publish_adapter(3, files)
    staged = stage_verified(store, 3, tmp_path / "staging")
    assert sorted(p.name for p in staged.iterdir()) == ["MANIFEST.json", "config.json", "model.safetensors"]
    got = load_file(staged / "model.safetensors")
    want = merged_state_dict(peft)
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: stored once, as HF does
    for k, v in got.items():
        assert torch.allclose(v, want[k], atol=1e-6), k
    # a corrupt adapter is refused before anything is staged
    store.write_bytes("weights/v000003/adapter_model.safetensors", files["adapter_model.safetensors"][:-8] + b"\0" * 8)
    with pytest.raises(WeightsError, match="adapter_model.safetensors fails its sha256"):
        stage_verified(store, 3, tmp_path / "staging2")
    assert not any((tmp_path / "staging2").glob("v*"))


@pytest.mark.slow
def test_a_lora_run_publishes_only_adapters_that_the_rollout_worker_loads(tiny_overrides):
    from safetensors.torch import load as st_load

    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.run.launcher import launch
    from areal_core.store import Store
    from areal_core.weights.reader import load_state_dict

    run_uri, _ = pipeline.prepare("", [*tiny_overrides, "train.lora_rank=4", "rollout.engine=continuous"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    cfg = load_run_config(store)
    launch(store.uri, 1, 1, timeout_s=300, progress=False)
    assert store.done() and store.latest_version() == cfg.train.steps
    for v in range(cfg.train.steps + 1):
        files = store.read_json(LAYOUT.manifest(v))["files"]
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files, v
    # the rollout worker sampled with adapter versions after v0
    versions = {v for rec in store.find("trainer/trained", ".json") for _, v in store.read_json(rec)["samples"]}
    assert max(versions) >= 1
    # the final model is base + the last adapter, as every engine loads it
    final = st_load(store.read_bytes(f"{LAYOUT.final_model}/model.safetensors"))
    merged = load_state_dict(store, cfg.train.steps)
    assert merged and all(torch.allclose(final[k], w, atol=1e-6) for k, w in merged.items())
    init = st_load(store.read_bytes(f"{LAYOUT.init_model}/model.safetensors"))
    assert any(not torch.equal(init[k], w) for k, w in merged.items())  # training moved the adapter


# -- vLLM on the real model ------------------------------------------------------------------------
def vllm_available() -> bool:
    from areal_core.config.run import DEFAULT_VLLM_PYTHON, resolve_python

    return resolve_python(DEFAULT_VLLM_PYTHON).exists()


def sft_adapter(model, tok, target: str, max_steps: int = 40):
    """A LoRA adapter on the last two layers, trained by SFT steps until the greedy answer to
    QUESTIONS[0] is `target` (teacher-forced argmax = target: greedy decoding then follows it)."""
    import copy

    from peft import LoraConfig, get_peft_model

    last = model.config.num_hidden_layers - 1
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["o_proj", "down_proj"], layers_to_transform=[last - 1, last])
    peft = get_peft_model(copy.deepcopy(model), cfg)
    prompt = chat_prompt(tok, QUESTIONS[0])
    answer = tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(max_steps):
        out = peft(input_ids=ids, labels=labels)
        if out.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist() == answer:
            return peft.eval()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    raise AssertionError(f"{max_steps} SFT steps did not make {target!r} the greedy answer")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(2400)  # the server's start alone took 10 min on the loaded 2-core machine
@pytest.mark.skipif(not vllm_available(), reason="vLLM venv absent (.venv-vllm/bin/python): run `make vllm-venv`")
def test_vllm_serves_smollm2_and_reloads_an_adapter_version(smollm2, smollm2_path, tmp_path):
    from areal_core.layout import LAYOUT
    from areal_core.rollout.vllm_engine import VLLMEngine
    from areal_core.rollout.vllm_server import VLLMServerSpec
    from areal_core.store import Store
    from areal_core.train.lora import adapter_files, merged_state_dict
    from areal_core.weights.publisher import WeightPublisher, hf_side_files, state_dict_bytes

    model, tok = smollm2
    store = Store(str(tmp_path / "run"))
    store.put_dir(str(smollm2_path), LAYOUT.init_model)
    store.write_json(LAYOUT.committed(LAYOUT.init_model), {})
    publisher = WeightPublisher(store, hf_side_files(model, tok))
    publisher.publish(0, state_dict_bytes(model))
    n = 24
    ps = chat_prompts(tok)
    params = SamplingParams(max_new_tokens=n, greedy=True)
    target = "12 + 35 = 47\n#### 47"
    peft = sft_adapter(model, tok, target)
    tuned = copy_with(model, merged_state_dict(peft))
    before = [hf_greedy(model, p, n, tok.eos_token_id, tok.pad_token_id) for p in ps]
    after = [hf_greedy(tuned, p, n, tok.eos_token_id, tok.pad_token_id) for p in ps]
    assert tok.decode(after[0], skip_special_tokens=True) == target != tok.decode(before[0], skip_special_tokens=True)
    engine = VLLMEngine.launch(
        store,
        0,
        tok.eos_token_id,
        VLLMServerSpec(kv_cache_mb=128, max_model_len=512, max_num_seqs=8, threads=2),
        log_path=tmp_path / "vllm.log",
    )
    try:
        gens = engine.generate(ps, params)
        assert [g.token_ids for g in gens] == before
        publisher.publish_adapter(1, adapter_files(peft))
        assert engine.receive(store, 1)
        gens = engine.generate(ps, params)
        assert [g.token_ids for g in gens] == after
        assert all(set(g.versions) == {1} for g in gens)
        assert engine.health()["ok"]
    finally:
        engine.close()


def copy_with(model, state: dict[str, torch.Tensor]):
    import copy

    out = copy.deepcopy(model)
    out.load_state_dict(state)
    return out.eval()


def test_a_bfloat16_rollout_engine_loads_float32_versions(tmp_path):
    from areal_core.config import load_config
    from areal_core.layout import LAYOUT
    from areal_core.rollout.factory import build_engine
    from areal_core.weights.publisher import WeightPublisher, state_dict_bytes

    model, other = tiny_llama(tied=False, bias=True), tiny_llama(tied=False, bias=True, seed=3)
    store, _ = lora_store(tmp_path, model)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")),
        pad_token="t0",
        eos_token="t1",
    )
    tok.save_pretrained(tmp_path / "tok")
    store.put_dir(str(tmp_path / "tok"), LAYOUT.init_model)
    publisher = WeightPublisher(store, {"config.json": b"{}"})
    publisher.publish(0, state_dict_bytes(model))
    publisher.publish(1, state_dict_bytes(other))
    cfg = load_config(None, ["rollout.engine=continuous", "rollout.dtype=bfloat16", f"store={store.uri}"])
    engine, _ = build_engine(cfg, store, 0)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    engine.receive(store, 1)
    gens = engine.generate(prompts(), SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert engine.version == 1 and all(g.versions == [1] * len(g.token_ids) for g in gens)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, other.state_dict()[name].to(torch.bfloat16)), name
    assert all(len(g.token_ids) == 6 or g.finish_reason == "stop" for g in gens)
    assert all(torch.isfinite(torch.tensor(g.logprobs)).all() for g in gens)


def test_adapter_versions_that_cannot_apply_are_refused_with_the_reason(tmp_path):
    import json

    from safetensors.torch import save

    from areal_core.layout import LAYOUT
    from areal_core.train.lora import adapter_files
    from areal_core.weights import WeightsError
    from areal_core.weights.publisher import WeightPublisher
    from areal_core.weights.reader import load_state_dict

    store, peft = lora_store(tmp_path, tiny_llama(tied=False, bias=False))
    publisher = WeightPublisher(store, {"config.json": b"{}"})
    files = adapter_files(peft)
    a = torch.zeros(4, 48)
    stray = {"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": a}
    stray["base_model.model.model.layers.7.mlp.up_proj.lora_B.weight"] = torch.zeros(96, 4)
    publisher.publish(1, {**files, "adapter_model.safetensors": save(stray)})
    # the refusal names the adapted weight (merged_weights names parameters: MoE experts have no .weight)
    with pytest.raises(WeightsError, match=r"v1: the adapter does not apply.*'model\.layers\.7\.mlp\.up_proj\.weight'"):
        load_state_dict(store, 1)
    cfg = json.loads(files["adapter_config.json"])
    publisher.publish(2, {**files, "adapter_config.json": json.dumps({**cfg, "r": "x"}).encode()})
    with pytest.raises(WeightsError, match="v2: the adapter does not apply"):
        load_state_dict(store, 2)
    with pytest.raises(ValueError, match="an adapter version is"):
        publisher.publish(3, {"adapter_model.safetensors": files["adapter_model.safetensors"]})
    other, _ = lora_store(tmp_path / "other", tiny_llama(tied=False, bias=False))  # base never read
    other.delete(LAYOUT.committed(LAYOUT.init_model))
    WeightPublisher(other, {"config.json": b"{}"}).publish(4, files)
    with pytest.raises(WeightsError, match="init_model is not committed"):
        load_state_dict(other, 4)
