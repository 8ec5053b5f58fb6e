"""The tiny Qwen2.5-VL and its processor, built in code; any Qwen2.5-VL folder loads by the same code.

    tokenizer = build_vlm_tokenizer(corpus, 384)
    processor = VisionProcessor(tokenizer, build_image_processor(image_size=64, patch_size=8))
    model = build_tiny_vlm(cfg.model, processor, seed=1)     # Qwen2_5_VLForConditionalGeneration
    processor.save_pretrained(folder); model.save_pretrained(folder)
    model, processor = load_vlm(folder)                        # or a real Qwen2.5-VL checkpoint

The tokenizer is the text model's byte-level BPE (areal_core.models.build_tokenizer) with the
Qwen2-VL vision tokens added; the chat template renders an `{"type": "image"}` content part as
`<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's own does. `VisionProcessor` is
the model's image processor (Qwen2VLImageProcessor, PIL backend: no torchvision needed) and its
tokenizer; it expands each image's pad token to the image's number of merged patches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from areal_core.layout import LAYOUT
from areal_core.models import BOS, EOS, PAD, build_tokenizer
from areal_core.vlm_processor import (  # noqa: F401 - re-exported: the VLM's names in one place
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    VL_CHAT_TEMPLATE,
    MMInputs,
    VisionProcessor,
)


def build_vlm_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """The text model's BPE tokenizer (models.build_tokenizer) plus the Qwen2-VL vision tokens."""
    tok = build_tokenizer(corpus, vocab_size)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def build_image_processor(image_size: int, patch_size: int, merge_size: int = 2) -> Any:
    """Qwen2-VL's image processor (PIL backend) resizing every image to about image_size² pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = image_size * image_size
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary half-dimension into (time, height, width): 16/24/24 of 64
    at head_dim 128, scaled to `head_dim`."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def build_tiny_vlm(cfg: Any, processor: VisionProcessor, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL from `cfg` (areal_core.config.ModelConfig: the LM sizes and vision_*), randomly
    initialised; its vision patch and merge sizes are the image processor's."""
    torch.manual_seed(seed)
    tok, ip = processor.tokenizer, processor.image_processor
    ids = tok.convert_tokens_to_ids
    vision_heads = max(1, cfg.vision_hidden_size // 32)
    unit = ip.patch_size * ip.merge_size
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": mrope_section(cfg.hidden_size // cfg.num_heads),
            },
            "tie_word_embeddings": True,
            "bos_token_id": ids(BOS),
            "eos_token_id": ids(EOS),
            "pad_token_id": ids(PAD),
        },
        vision_config={
            "depth": cfg.vision_layers,
            "hidden_size": cfg.vision_hidden_size,
            "intermediate_size": 2 * cfg.vision_hidden_size,
            "num_heads": vision_heads,
            "patch_size": ip.patch_size,
            "spatial_merge_size": ip.merge_size,
            "temporal_patch_size": ip.temporal_patch_size,
            "window_size": 2 * unit,
            "out_hidden_size": cfg.hidden_size,
            "fullatt_block_indexes": [cfg.vision_layers - 1],
        },
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config).float()


def is_vlm_folder(folder: str | Path) -> bool:
    """Whether the HF folder holds a vision-language model (its config has a vision_config)."""
    path = Path(folder) / LAYOUT.hf_config
    return path.exists() and "vision_config" in json.loads(path.read_text())


def load_vlm(path: str, device: str = "cpu") -> tuple[Any, VisionProcessor]:
    """(model, processor) of a Qwen2.5-VL folder or URI: the tiny one or a real checkpoint."""
    from areal_core.models import load_pretrained

    model, processor = load_pretrained(path, device)
    if not isinstance(processor, VisionProcessor):
        raise ValueError(f"{path} is not a vision-language model folder (its config.json has no vision_config)")
    return model, processor


def save_vlm(model: Any, processor: VisionProcessor, out_dir: str | Path) -> None:
    from areal_core.models import save_pretrained

    save_pretrained(model, processor, out_dir)


def freeze_vision_tower(model: Any) -> int:
    """Turn off the gradients of a Qwen2.5-VL's vision tower and merger (`model.model.visual`, the
    same module under peft); returns the number of parameters frozen. ValueError without one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    visual = getattr(getattr(base, "model", None), "visual", None)
    if visual is None:
        raise ValueError(f"{type(base).__name__} has no vision tower (model.visual) to freeze")
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())
