"""Tiny random checkpoints of real Hugging Face decoder classes, saved as a hub download looks
(config.json, model.safetensors, a real tokenizer with a chat template), so that loading them
takes the code path a user's checkpoint takes.

    python -m benchmarks.tiny_checkpoints OUT_DIR [NAME ...]    # write folders, e.g. to try `pyflyte run`
    python -m benchmarks.tiny_checkpoints --docs                 # regenerate docs/architectures.md's table

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
    # beyond the Llama family: the torch engine and the trainer run them through their own forward
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    ),
    "olmo2": ("Olmo2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25}),  # partial rotary, fused query_key_value
    # MLA, a dense first layer, a shared expert; gpt-oss: sinks, alternating windows, YaRN; GPT-2: Conv1D
    "deepseek_v3": (
        "DeepseekV3Config",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
        | {"n_shared_experts": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
        | {"qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4},
    ),
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16}
        | {"sliding_window": WINDOW},
    ),
    "gpt2": ("GPT2Config", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),  # no dropout, as the rest
}

CORPUS = [f"What is {a} + {b}? The answer is {a + b}.\n#### {a + b}" for a in range(10) for b in range(10)]


def tokenizer() -> Any:
    """A byte-level BPE tokenizer with a ChatML chat template (areal_core.models.build_tokenizer)."""
    return build_tokenizer(CORPUS, VOCAB)


def config(name: str, tok: Any | None = None, **overrides: Any) -> Any:
    """The transformers config of architecture `name` (ARCHS), `overrides` applied last."""
    tok = tok or tokenizer()
    cls, extra = ARCHS[name]
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    return getattr(transformers, cls)(vocab_size=len(tok), **ids, **(_BASE | extra | overrides))


def model(name: str, seed: int = 0, tok: Any | None = None, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised float32 model of architecture `name` (config `overrides` applied last), in eval mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(name, tok, **overrides)).float().eval()


def save(name: str, out_dir: str | Path, seed: int = 0, chat_template: bool = True) -> Path:
    """Write a checkpoint folder of architecture `name` (with or without a chat template)."""
    tok = tokenizer()
    if not chat_template:
        tok.chat_template = None
    out = Path(out_dir)
    model(name, seed, tok).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# -- the supported-architecture table of docs/architectures.md, generated here --------------------

TABLE_BEGIN, TABLE_END = "<!-- table: python -m benchmarks.tiny_checkpoints --docs -->", "<!-- end of table -->"


def support_row(name: str) -> list[str]:
    """One row of the table: what the project's code does with a checkpoint of `name`, each
    equality measured (max |Δ log p| < 1e-5 in float32 against the HF forward)."""
    import copy

    from areal_core.architecture import attention_windows, resolve_lora_targets
    from areal_core.rollout.continuous_engine import ContinuousEngine
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.factory import local_engine_kind
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.train.packing import packed_token_logprobs

    tok = tokenizer()
    m = model(name, tok=tok)
    vocab = len(tok)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (12,), generator=g).tolist()
    seqs = [prompt + torch.randint(3, vocab, (10 + 4 * j,), generator=g).tolist() for j in range(3)]

    def hf(seq: list[int]) -> torch.Tensor:
        ids = torch.tensor([seq])
        with torch.no_grad():
            return torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]

    width = max(map(len, seqs))
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        lp = packed_token_logprobs(m, ids, mask, group_index=torch.zeros(3, dtype=torch.long))
    trainer_ok = max(float((lp[i, 1 : len(s)] - hf(s)).abs().max()) for i, s in enumerate(seqs)) < 1e-5
    engines = {"torch": TorchEngine(copy.deepcopy(m), tok.pad_token_id, tok.eos_token_id)}
    if local_engine_kind("auto", m) == "continuous":
        engines["continuous"] = ContinuousEngine(copy.deepcopy(m), tok.pad_token_id, tok.eos_token_id, slots=2)
    equal = ["trainer (packed)"] if trainer_ok else []
    for kind, engine in engines.items():
        gens = engine.generate([prompt], SamplingParams(max_new_tokens=16, seed=1))
        ref = hf(prompt + gens[0].token_ids)[len(prompt) - 1 :]
        if float((ref - torch.tensor(gens[0].logprobs)).abs().max()) < 1e-5:
            equal.append(kind)
    lora = ", ".join(resolve_lora_targets(m))
    windows = attention_windows(m.config)
    window = "none" if not any(windows) else "/".join("full" if w is None else str(w) for w in windows)
    return [name, f"`{type(m).__name__}`", ", ".join(sorted(engines)), lora, window, ", ".join(equal)]


def support_table() -> str:
    head = ["checkpoint", "class", "built-in engines", "LoRA targets (default)", "window per layer"]
    head.append("equal to HF (< 1e-5)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(support_row(name)) + " |" for name in ARCHS]
    return "\n".join(lines) + "\n\n" + lora_table()


def lora_table() -> str:
    """The default LoRA targets per model_type (areal_core.architecture.LORA_TARGETS)."""
    from areal_core.architecture import LORA_TARGETS

    lines = ["| model_type | LoRA modules (default) | LoRA parameters (default) |", "|---|---|---|"]
    for kind, t in sorted(LORA_TARGETS.items()):
        lines.append(f"| {kind} | {', '.join(t.modules)} | {', '.join(t.parameters) or '-'} |")
    return "\n".join(lines)


def docs_with_table(text: str) -> str:
    """docs/architectures.md `text` with the table between its markers regenerated."""
    start, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    return text[:start] + "\n" + support_table() + "\n" + text[end:]


if __name__ == "__main__":
    if sys.argv[1] == "--docs":
        doc = Path(__file__).resolve().parent.parent / "docs" / "architectures.md"
        doc.write_text(docs_with_table(doc.read_text()))
    else:
        for arch in sys.argv[2:] or list(ARCHS):
            print(save(arch, Path(sys.argv[1]) / arch))
