"""A vision-language model's processor: its tokenizer (chat template included) and its image
processor, turning prompts with images into token ids and MMInputs (docs/vlm.md). Every role
that loads a VLM folder holds one in place of a tokenizer (models.load_pretrained). It imports
nothing of areal_core and sits beside models.py, below vlm/ (which imports models.py), so the two
never import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

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


class VisionProcessor:
    """The model's tokenizer and image processor: prompts with images become token ids (one pad
    token per merged patch) and MMInputs. The trainer and the engines rebuild pixels with it."""

    def __init__(self, tokenizer: Any, image_processor: Any):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        if tokenizer.chat_template is None:
            tokenizer.chat_template = VL_CHAT_TEMPLATE
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.merge_size = int(image_processor.merge_size)

    # the processor stands in for the tokenizer wherever a role holds one (models.load_pretrained):
    # tokenizer attributes and calls go to the tokenizer
    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def __getattr__(self, name: str) -> Any:
        if name in ("tokenizer", "image_processor") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

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
        from areal_core.hf_load import load_image_processor, load_tokenizer  # no code of the folder runs

        return cls(load_tokenizer(folder), load_image_processor(folder, backend="pil"))
