"""HF ⇄ Megatron weight conversion and tensor-parallel sharding (areal_core/megatron/), pure torch:
a tiny Qwen2 and a tiny Llama (transformers' own classes) round-trip byte-exact HF → Megatron
(TP 1 and TP 2 shards) → HF, and the Megatron-layout shards compute the HF model's logits
(`reference.py`, which reads the layout as megatron-core's forward does)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.megatron.convert import fuse_qkv, hf_to_megatron, megatron_to_hf, pad_vocab_size, split_qkv
from areal_core.megatron.reference import reference_logits
from areal_core.megatron.shapes import ModelShape, shape_from_hf_config
from areal_core.megatron.shard import shard_state_dict, split_rule, unshard_state_dict

VOCAB = 96


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of the family with every parameter random (biases and norms included)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    common.update(max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen2":  # q/k/v biases, untied output layer, a non-default rope theta
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6))
    else:  # no biases, tied embeddings, head_dim (16) != hidden_size / heads (8)
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=16, tie_word_embeddings=True))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(noise + 1.0 if name.endswith("norm.weight") else noise)
    return model.to(dtype).eval()


def expected_hf(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as a safetensors file holds it: no lm_head when tied."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def ids_batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_fuse_qkv_is_megatrons_per_group_layout():
    # 4 query heads in 2 groups, kv_channels 1: rows [q0 q1 k0 v0 | q2 q3 k1 v1]
    shape = ModelShape(1, 4, 4, 2, 8, 10, 16, head_dim=1)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    qkv = fuse_qkv(q, k, v, shape)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, shape), (q, k, v)))
    # TP 2: rank r holds query group r whole, with its k and v
    shards = shard_state_dict({"decoder.layers.0.self_attention.linear_qkv.bias": qkv.flatten()}, 2, shape)
    assert [s["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() for s in shards] == [
        [0, 1, 10, 20],
        [2, 3, 11, 21],
    ]


def test_fc1_shards_hold_their_gate_and_up_halves():
    fc1 = torch.arange(8.0).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    shards = shard_state_dict({"decoder.layers.0.mlp.linear_fc1.weight": fc1}, 2)
    got = [s["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() for s in shards]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(unshard_state_dict(shards)["decoder.layers.0.mlp.linear_fc1.weight"], fc1)


def test_every_parameter_has_a_tensor_parallel_rule():
    rules = {k: split_rule(k) for k in hf_to_megatron(tiny_model("qwen2").state_dict(), shape_of("qwen2"))}
    assert {k.split("layers.0.")[-1]: r for k, r in rules.items() if "layers.1." not in k} == {
        "embedding.word_embeddings.weight": "column",
        "input_layernorm.weight": "replicated",
        "self_attention.linear_qkv.weight": "column",
        "self_attention.linear_qkv.bias": "column",
        "self_attention.linear_proj.weight": "row",
        "pre_mlp_layernorm.weight": "replicated",
        "mlp.linear_fc1.weight": "glu",
        "mlp.linear_fc2.weight": "row",
        "decoder.final_layernorm.weight": "replicated",
        "output_layer.weight": "column",
    }
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        split_rule("decoder.layers.0.self_attention.mystery.weight")


def shape_of(family: str) -> ModelShape:
    return shape_from_hf_config(tiny_model(family).config)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "family,dtype", [("qwen2", torch.float32), ("llama", torch.float32), ("qwen2", torch.bfloat16)], ids=str
)
def test_hf_megatron_hf_round_trip_is_byte_exact_and_computes_the_hf_logits(family, dtype, tp):
    model = tiny_model(family, dtype)
    shape = shape_from_hf_config(model.config)
    mg = hf_to_megatron(model.state_dict(), shape)
    assert ("output_layer.weight" in mg) == (not shape.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (family == "qwen2")
    shards = shard_state_dict(mg, tp, shape)
    assert all(t.dtype == dtype for s in shards for t in s.values())
    back = megatron_to_hf(unshard_state_dict(shards), shape)
    want = expected_hf(model)
    assert sorted(back) == sorted(want)
    assert st_save(back) == st_save(want)  # byte for byte
    if dtype == torch.float32:  # bf16 reduction orders differ too much for a tight bound
        ids = ids_batch()
        torch.testing.assert_close(reference_logits(shards, shape, ids), hf_logits(model, ids), atol=2e-5, rtol=1e-5)


def test_a_plain_q_k_v_concatenation_computes_something_else():
    """The logits check has teeth: [q; k; v] (not per group) round-trips but is another model."""
    model = tiny_model("qwen2")
    shape = shape_from_hf_config(model.config)
    mg = hf_to_megatron(model.state_dict(), shape)
    sd = model.state_dict()
    for i in range(shape.num_layers):
        parts = [sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        mg[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat(parts)
    ids = ids_batch()
    assert not torch.allclose(reference_logits([mg], shape, ids), hf_logits(model, ids), atol=1e-3)


def test_a_padded_vocabulary_round_trips_and_keeps_the_logits():
    model = tiny_model("qwen2")
    shape = shape_from_hf_config(model.config)
    padded = pad_vocab_size(VOCAB, 2, divisible_by=64)
    assert padded == 128
    mg = hf_to_megatron(model.state_dict(), shape, padded_vocab_size=padded)
    assert mg["embedding.word_embeddings.weight"].shape[0] == mg["output_layer.weight"].shape[0] == padded
    shards = shard_state_dict(mg, 2, shape)
    assert st_save(megatron_to_hf(unshard_state_dict(shards), shape)) == st_save(expected_hf(model))
    ids = ids_batch()
    torch.testing.assert_close(reference_logits(shards, shape, ids), hf_logits(model, ids), atol=2e-5, rtol=1e-5)


def test_transformer_engine_names_round_trip():
    model = tiny_model("llama")
    shape = shape_from_hf_config(model.config)
    mg = hf_to_megatron(model.state_dict(), shape, te_layout=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mg
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in mg)
    mg["decoder.layers.0.mlp.linear_fc1._extra_state"] = None  # TE's fp8 metadata is ignored
    back = megatron_to_hf(unshard_state_dict(shard_state_dict(mg, 2, shape)), shape, te_layout=True)
    assert st_save(back) == st_save(expected_hf(model))


def test_shape_from_config_json_equals_shape_from_the_config_object():
    for family in ("qwen2", "llama"):
        cfg = tiny_model(family).config
        assert shape_from_hf_config(cfg.to_dict()) == shape_from_hf_config(cfg)
    assert shape_of("qwen2").qkv_bias and shape_of("qwen2").rope_theta == 1e6
    assert not shape_of("llama").qkv_bias and shape_of("llama").kv_channels == 16


def test_what_does_not_convert_or_shard_raises():
    model = tiny_model("llama")
    shape = shape_from_hf_config(model.config)
    sd = model.state_dict()
    with pytest.raises(ValueError, match="does not know"):
        hf_to_megatron({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, shape)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_megatron({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, shape)
    mg = hf_to_megatron(sd, shape)
    with pytest.raises(ValueError, match="must divide num_kv_heads=2"):
        shard_state_dict(mg, 4, shape)
    shards = shard_state_dict(mg, 2, shape)
    shards[1]["decoder.final_layernorm.weight"] = shards[1]["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="replicated over TP ranks but differs"):
        unshard_state_dict(shards)
    del shards[1]["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match="other keys"):
        unshard_state_dict(shards)
