import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model
from areal_core.store import Store
from areal_core.weights import WeightsError
from areal_core.weights.publisher import publish, state_dict_bytes
from areal_core.weights.reader import load_state_dict


def test_publish_then_load_verifies_checksums(tmp_path):
    store = Store(str(tmp_path))
    model = build_tiny_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), 50, 0
    )
    publish(store, 3, state_dict_bytes(model), {"config.json": b"{}"})
    assert store.latest_version() == 3
    assert set(store.read_json("weights/v000003/MANIFEST.json")["files"]) == {"model.safetensors", "config.json"}
    sd = load_state_dict(store, 3)
    assert torch.equal(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    store.write_bytes("weights/v000003/model.safetensors", b"tampered")
    with pytest.raises(WeightsError, match="sha256"):
        load_state_dict(store, 3)
    with pytest.raises(WeightsError, match="incomplete"):
        load_state_dict(store, 4)
