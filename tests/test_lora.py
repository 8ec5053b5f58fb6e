"""LoRA via peft: only adapters train, adapter-only publication merges back into a plain model,
and gradient checkpointing changes memory, not numbers."""

import copy
import json

import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model

pytest.importorskip("peft")

from areal_core.train.lora import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_files,
    apply_lora,
    is_gradient_checkpointing,
    merge_adapter,
    merged_state_dict,
    set_gradient_checkpointing,
    trainable_parameters,
)

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
VOCAB = 50


def tiny():
    return build_tiny_model(CFG, VOCAB, seed=0)


def train_a_little(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ids


def test_only_adapters_train_and_base_stays_frozen():
    base = tiny()
    before = copy.deepcopy(base.state_dict())
    peft_model = apply_lora(base, r=4, alpha=8)
    trainable, total = trainable_parameters(peft_model)
    # 2 layers × (q,k,v,o,gate,up,down) with r = 4: A is r×in, B is out×r
    dims = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32), "g": (32, 64), "u": (32, 64), "d": (64, 32)}
    assert trainable == 2 * sum(4 * i + o * 4 for i, o in dims.values())
    assert trainable < total
    train_a_little(peft_model)
    after = peft_model.get_base_model().state_dict()
    for k, v in before.items():
        mod, name = k.rsplit(".", 1)
        key = k if k in after else f"{mod}.base_layer.{name}"
        assert torch.equal(after[key], v), k


def test_adapter_publication_merges_into_a_plain_model():
    plain = tiny()
    peft_model = apply_lora(tiny(), r=4, alpha=8)
    ids = train_a_little(peft_model)
    files = adapter_files(peft_model)
    assert set(files) == {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    assert json.loads(files[ADAPTER_CONFIG])["r"] == 4
    full_bytes = sum(p.numel() * 4 for p in plain.parameters())
    assert len(files[ADAPTER_WEIGHTS]) < full_bytes / 4
    with torch.no_grad():
        before = plain(input_ids=ids).logits
        assert merge_adapter(plain, files) == 14  # 7 projections × 2 layers
        want = peft_model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert (before - want).abs().max() > 1e-3  # the adapter did change the model
    assert torch.allclose(got, want, atol=1e-5)
    merged = merged_state_dict(peft_model)
    assert set(merged) == set(plain.state_dict())
    assert all(torch.allclose(merged[k], v, atol=1e-6) for k, v in plain.state_dict().items())


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for enabled in (False, True):
        model = tiny()
        model.train()
        set_gradient_checkpointing(model, enabled)
        assert is_gradient_checkpointing(model) == enabled
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    peft_model = apply_lora(tiny(), r=4, alpha=8)
    set_gradient_checkpointing(peft_model, True)
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()  # frozen inputs: non-reentrant works
    assert all(p.grad is not None for p in peft_model.parameters() if p.requires_grad)
