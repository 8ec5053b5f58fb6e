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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from areal_core.models import BOS, EOS, PAD, build_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# ChatML whose content may be a list of parts (OpenAI / Qwen2.5-VL shape): an image part becomes
# the vision placeholder, a text part its text; a plain string renders as the text template does.
VL_CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{%- else %}{%- for c in m.content %}"
    "{%- if c.type == 'image' or c.type == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c.type == 'text' %}{{ c.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class MMInputs:
    """One prompt's images as model inputs: pixel_values [patches, C·T·P·P], image_grid_thw [images, 3]."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @staticmethod
    def cat(items: list[MMInputs | None]) -> MMInputs | None:
        """The images of several prompts in order (None: no image anywhere)."""
        got = [m for m in items if m is not None and len(m.image_grid_thw)]
        if not got:
            return None
        return MMInputs(torch.cat([m.pixel_values for m in got]), torch.cat([m.image_grid_thw for m in got]))


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


class VisionProcessor:
    """The model's tokenizer and image processor: prompts with images become token ids (one pad
    token per merged patch) and MMInputs. The trainer and the engines rebuild pixels with it."""

    def __init__(self, tokenizer: Any, image_processor: Any):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        if tokenizer.chat_template is None:
            tokenizer.chat_template = VL_CHAT_TEMPLATE
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.merge_size = int(image_processor.merge_size)

    # HF tokenizer attributes the rest of the project reads
    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def pixels(self, images: list[Image.Image]) -> MMInputs:
        out = self.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
        return MMInputs(out["pixel_values"].float(), out["image_grid_thw"].long())

    def image_tokens(self, grid: torch.Tensor) -> list[int]:
        """Pad tokens per image: t·h·w / merge²."""
        return [int(g.prod()) // self.merge_size**2 for g in grid]

    def messages(self, question: str, n_images: int, system: str = "") -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
        parts.append({"type": "text", "text": question})
        head = [{"role": "system", "content": system}] if system else []
        return [*head, {"role": "user", "content": parts}]

    def encode_messages(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> tuple[list[int], MMInputs]:
        """Token ids of `messages` in the chat template (ending with the assistant header), each
        image's placeholder expanded to its patch count, and the images as MMInputs."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        mm = self.pixels(images) if images else MMInputs(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))
        counts = self.image_tokens(mm.image_grid_thw)
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"{len(pieces) - 1} image placeholders in the prompt for {len(counts)} images")
        expanded = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        if sum(t == self.image_token_id for t in ids) != sum(counts):
            raise ValueError("the prompt's text holds image pad tokens of its own")
        return list(ids), mm

    def encode(self, question: str, images: list[Image.Image], system: str = "") -> tuple[list[int], MMInputs]:
        return self.encode_messages(self.messages(question, len(images), system), images)

    def save_pretrained(self, out_dir: str | Path) -> None:
        self.tokenizer.save_pretrained(out_dir)
        self.image_processor.save_pretrained(out_dir)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> VisionProcessor:
        return cls(AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder, backend="pil"))


def is_vlm_folder(folder: str | Path) -> bool:
    """Whether the HF folder holds a vision-language model (its config has a vision_config)."""
    path = Path(folder) / "config.json"
    return path.exists() and "vision_config" in json.loads(path.read_text())


def load_vlm(path: str, device: str = "cpu") -> tuple[Any, VisionProcessor]:
    """(model, processor) of a Qwen2.5-VL folder or URI: the tiny one or a real checkpoint."""
    from areal_core.models import load_pretrained, localize

    local = localize(path)
    model, _ = load_pretrained(local, device)
    return model, VisionProcessor.from_pretrained(local)


def save_vlm(model: Any, processor: VisionProcessor, out_dir: str | Path) -> None:
    from areal_core.models import save_pretrained

    save_pretrained(model, processor, out_dir)
