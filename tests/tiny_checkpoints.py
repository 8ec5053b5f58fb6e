"""Tiny random checkpoints of real Hugging Face decoder classes, saved as a hub download looks
(config.json, model.safetensors, a real tokenizer with a chat template), so that loading them
takes the code path a user's checkpoint takes.

    python -m tests.tiny_checkpoints OUT_DIR [NAME ...]    # write folders, e.g. to try `pyflyte run`

Every windowed architecture gets a window (8) shorter than the rows the tests use (> 20 tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from areal_core.models import build_tokenizer

WINDOW = 8
VOCAB = 300
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (config class, its settings beyond _BASE)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False, "attention_dropout": 0.0}),
    "qwen2_window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "tie_word_embeddings": True},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": WINDOW}),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, **_MOE}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE, "shared_expert_intermediate_size": 64}),
}

CORPUS = [f"What is {a} + {b}? The answer is {a + b}.\n#### {a + b}" for a in range(10) for b in range(10)]


def tokenizer() -> Any:
    """A byte-level BPE tokenizer with a ChatML chat template (areal_core.models.build_tokenizer)."""
    return build_tokenizer(CORPUS, VOCAB)


def config(name: str, tok: Any | None = None) -> Any:
    tok = tok or tokenizer()
    cls, extra = ARCHS[name]
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    return getattr(transformers, cls)(vocab_size=len(tok), **_BASE, **ids, **extra)


def model(name: str, seed: int = 0, tok: Any | None = None) -> torch.nn.Module:
    """A randomly initialised float32 model of architecture `name`, in eval mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(name, tok)).float().eval()


def save(name: str, out_dir: str | Path, seed: int = 0, chat_template: bool = True) -> Path:
    """Write a checkpoint folder of architecture `name` (with or without a chat template)."""
    tok = tokenizer()
    if not chat_template:
        tok.chat_template = None
    out = Path(out_dir)
    model(name, seed, tok).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for arch in sys.argv[2:] or list(ARCHS):
        print(save(arch, root / arch))
