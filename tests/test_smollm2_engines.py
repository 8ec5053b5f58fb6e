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
    return [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True))
        for q in QUESTIONS
    ]


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
