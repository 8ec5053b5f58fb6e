"""Tokenizer and model factory: the tiny default built in code, or any HF checkpoint.

The tiny default is a Qwen2-architecture causal LM from `transformers` created from a
config, with a byte-level BPE tokenizer trained in code on the task's text (digits kept
one per token) and saved in HF format with a chat template.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from areal_core.layout import LAYOUT

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML with the Qwen2 tool convention, written so a plain conversation renders exactly as the
# ChatML the tiny model was always trained on: one `<|im_start|>{role}\n{content}<|im_end|>\n` per
# message; `tools` as a `# Tools` system message first; an assistant's calls as
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after its content (arguments given as a
# JSON string, OpenAI's shape, are written as they are, as Qwen2.5's template does).
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\nTo call a tool, write <tool_call>"
    '{"name": <tool name>, "arguments": <JSON object>}</tool_call>. Available tools:'
    "{%- for t in tools %}{{ '\\n' ~ ((t.function if t.function is defined else t) | tojson) }}{%- endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.function.name | tojson }}, '
    '"arguments": {{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}'
    "</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`; digits are split one per token so arithmetic stays learnable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus + ["user", "assistant", "system"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(cfg: Any, vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    """A Qwen2 model created from `cfg` (areal_core.config.ModelConfig), randomly initialised."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = Qwen2ForCausalLM(config)
    return model.float()


def chat_prompt(tokenizer: Any, question: str, system: str = "", chat: list[dict[str, str]] | None = None) -> list[int]:
    """Token ids of the question (after a `system` message when one is given) in the tokenizer's
    chat template, ending with the assistant header. `chat`: a record's whole conversation
    (`meta.chat`), rendered as it is; `system` goes first only when it has no system message. A
    chat ending with an assistant message is continued (its text a prefill the completion follows,
    left open), as TRL renders such a prompt."""
    messages = prompt_messages(question, system, chat)
    prefill = messages[-1]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        tokenize=True,
        return_dict=False,
        sanitize_control_tokens=True,
    )
    return list(ids)


def prompt_messages(question: str, system: str = "", chat: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    """The messages a prompt is rendered from: the record's chat, else the question as the user's
    message; `system` (task.system_prompt) first unless the chat brings its own system message."""
    messages = [dict(m) for m in chat] if chat else [{"role": "user", "content": question}]
    if system and not any(m["role"] in ("system", "developer") for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def task_prompt(
    tokenizer: Any,
    question: str,
    system: str = "",
    prompt_format: str = "chat",
    chat: list[dict[str, str]] | None = None,
) -> list[int]:
    """Token ids of a task's question as `task.prompt_format` asks: "chat" (`chat_prompt`) or
    "plain", the text `{system}\n\n{question}\n` (`{question}\n` without a system prompt; a
    chat's messages joined by blank lines) with the tokenizer's own special tokens (a BOS where it
    adds one), for base models without a template."""
    if prompt_format == "chat":
        return chat_prompt(tokenizer, question, system, chat)
    if prompt_format != "plain":
        raise ValueError(f"task.prompt_format must be chat or plain, got {prompt_format!r}")
    text = "\n\n".join(m["content"] for m in prompt_messages(question, system, chat)) + "\n"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def record_prompt(tokenizer: Any, record: dict[str, Any], system: str = "", prompt_format: str = "chat") -> list[int]:
    """`task_prompt` of a prompt record: its whole chat (`meta.chat`) when it has one."""
    return task_prompt(tokenizer, record["prompt"], system, prompt_format, (record.get("meta") or {}).get("chat"))


def load_pretrained(path: str, device: str = "cpu", tokenizer: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) from a local folder or an fsspec URI of an HF checkpoint, checked against
    its MANIFEST.json when it has one (init_model/ does: areal_core/manifest.py), loaded without
    running anything it holds (areal_core/hf_load.py). A vision-language folder gives its
    VisionProcessor as the tokenizer (it answers as one, and holds the image processor).
    `tokenizer=False` loads the model only (the tokenizer is None): a weights-only reader needs no
    tokenizer files."""
    from areal_core.hf_load import load_model, load_tokenizer
    from areal_core.logs import quiet_libraries
    from areal_core.manifest import verify_local_dir

    quiet_libraries()
    local = localize(path)
    verify_local_dir(local)
    if "vision_config" in json.loads((Path(local) / LAYOUT.hf_config).read_text()):  # model.kind vlm (docs/vlm.md)
        from transformers import AutoModelForImageTextToText

        from areal_core.vlm_processor import VisionProcessor

        model = load_model(AutoModelForImageTextToText, local, dtype=torch.float32).to(device)
        return model, VisionProcessor.from_pretrained(local) if tokenizer else None  # and the image processor
    tok = load_tokenizer(local) if tokenizer else None
    if tok is not None and tok.pad_token_id is None and tok.eos_token is not None:  # base Llama/Mistral: pad with EOS
        tok.pad_token = tok.eos_token
    model = load_model(AutoModelForCausalLM, local, dtype=torch.float32).to(device)
    model.stored_dtype = checkpoint_dtype(local)  # trained in float32; written back as the user stored it
    return model, tok


def localize(path: str) -> str:
    """A local folder for `path`: as is, `pretrained:NAME` (areal_core.pretrained, fetched and
    cached), or an fsspec URI copied to a temporary folder."""
    if path.startswith("pretrained:"):
        from areal_core.pretrained import resolve

        return resolve(path)
    if "://" not in path or path.startswith("file://"):
        return path.removeprefix("file://")
    from areal_core.store import Store

    dst = tempfile.mkdtemp(prefix="areal-ckpt-")
    Store(path).get_dir("", dst)
    return dst


def checkpoint_dtype(folder: str | Path) -> torch.dtype:
    """The dtype an HF folder's weights are stored in (config.json's `dtype`, or the older
    `torch_dtype`): bfloat16 or float16 as stored, float32 otherwise."""
    try:
        return config_dtype(json.loads((Path(folder) / LAYOUT.hf_config).read_text()))
    except (OSError, ValueError):
        return torch.float32


def config_dtype(cfg: dict) -> torch.dtype:
    """The weights' dtype a config.json names: bfloat16, float16, else float32."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name), torch.float32)


def save_pretrained(model: Any, tokenizer: Any, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """`model` and `tokenizer` (or a VLM's areal_core.vlm_processor.VisionProcessor) as an HF folder;
    with a half-precision `dtype`, the weights are written in it (the model itself is unchanged)."""
    from areal_core.logs import quiet_libraries

    quiet_libraries()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if dtype in (torch.bfloat16, torch.float16):
        state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
        model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        config = Path(out_dir) / LAYOUT.hf_config
        written = json.loads(config.read_text())
        written["dtype"] = str(dtype).removeprefix("torch.")
        config.write_text(json.dumps(written, indent=2))
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sft_loss(model, batch: list[tuple[list[int], int | list[int]]], pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over answer tokens only: those after the prompt length, or
    those where the example's loss mask is 1."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (seq, where) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        if isinstance(where, int):
            labels[i, where : len(seq)] = torch.tensor(seq[where:])
        else:
            labels[i, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, where)])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
