"""Supervised warm start of a vision-language model: next-token cross-entropy on the answer tokens
of image+text demonstrations (the VLM counterpart of models.sft_loss).

    examples = [demonstration(processor, question, images, answer) for ...]
    loss = vision_sft_loss(model, processor.pad_token_id, processor.image_token_id, batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from areal_core.vlm.inputs import MultimodalRows
from areal_core.vlm.model import MMInputs, VisionProcessor


@dataclass
class Demonstration:
    ids: list[int]  # prompt (vision tokens included) + answer + EOS
    prompt_len: int
    mm: MMInputs | None


def demonstration(
    processor: VisionProcessor, question: str, images: list[Image.Image], answer: str, system: str = ""
) -> Demonstration:
    prompt, mm = processor.encode(question, images, system)
    tok = processor.tokenizer
    reply = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Demonstration(prompt + reply, len(prompt), mm if images else None)


def vision_sft_loss(model: Any, pad_id: int, image_token_id: int, batch: list[Demonstration]) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of `batch`, the images in the forward pass."""
    width = max(len(d.ids) for d in batch)
    device = next(model.parameters()).device
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, d in enumerate(batch):
        ids[i, : len(d.ids)] = torch.tensor(d.ids)
        attn[i, : len(d.ids)] = 1
        labels[i, d.prompt_len : len(d.ids)] = torch.tensor(d.ids[d.prompt_len :])
    ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
    extra = MultimodalRows([d.mm for d in batch], image_token_id).model_inputs(model, None, ids, attn)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **extra).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
