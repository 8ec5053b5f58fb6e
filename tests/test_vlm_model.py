"""model.kind vlm: the tiny Qwen2.5-VL builds, saves and loads as an HF folder with its image
processor, tokenizer and chat template; a folder saved from a second tiny config (another size,
patch and image size: what a real checkpoint's folder differs in) loads by the same code."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from areal_core.config import RunConfig
from areal_core.models import load_pretrained
from areal_core.vlm.model import (
    IMAGE_PAD,
    VisionProcessor,
    build_image_processor,
    build_tiny_vlm,
    build_vlm_tokenizer,
    is_vlm_folder,
    load_vlm,
    save_vlm,
)


def tiny(model_overrides: dict | None = None, seed: int = 1) -> tuple[torch.nn.Module, VisionProcessor]:
    m = RunConfig().model.model_copy(
        update={"kind": "vlm", "hidden_size": 64, "num_layers": 2, "intermediate_size": 128, **(model_overrides or {})}
    )
    tok = build_vlm_tokenizer(["how many red shapes? 3", "is there a circle? yes"], 300)
    processor = VisionProcessor(tok, build_image_processor(m.image_size, m.patch_size))
    return build_tiny_vlm(m, processor, seed), processor


def picture(size: int = 64, colour: tuple[int, int, int] = (200, 30, 30)) -> Image.Image:
    im = Image.new("RGB", (size, size), (240, 240, 240))
    im.paste(colour, (8, 8, 24, 24))
    return im


def logits(model, processor: VisionProcessor, image: Image.Image) -> torch.Tensor:
    ids, mm = processor.encode("how many red shapes?", [image])
    with torch.no_grad():
        return model(
            input_ids=torch.tensor([ids]),
            pixel_values=mm.pixel_values,
            image_grid_thw=mm.image_grid_thw,
            mm_token_type_ids=(torch.tensor([ids]) == processor.image_token_id).int(),
        ).logits


def test_the_tiny_vlm_builds_saves_and_loads(tmp_path):
    model, processor = tiny()
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert model.model.visual is not None and sum(p.numel() for p in model.parameters()) < 2_000_000
    ids, mm = processor.encode("how many red shapes?", [picture()])
    assert ids.count(processor.image_token_id) == 16  # 64² pixels, 8-pixel patches, 2×2 merged
    assert mm.image_grid_thw.tolist() == [[1, 8, 8]]
    before = logits(model, processor, picture())
    save_vlm(model, processor, tmp_path)
    assert is_vlm_folder(tmp_path) and (tmp_path / "preprocessor_config.json").exists()
    loaded, proc2 = load_vlm(str(tmp_path))
    assert isinstance(loaded, Qwen2_5_VLForConditionalGeneration)
    assert proc2.tokenizer.convert_tokens_to_ids(IMAGE_PAD) == processor.image_token_id
    assert proc2.encode("how many red shapes?", [picture()])[0] == ids  # same template and expansion
    torch.testing.assert_close(logits(loaded, proc2, picture()), before)
    # every role's loader (models.load_pretrained) gives the same model class
    assert isinstance(load_pretrained(str(tmp_path))[0], Qwen2_5_VLForConditionalGeneration)


def test_a_second_config_folder_loads_through_model_path(tmp_path):
    other, processor = tiny({"hidden_size": 96, "num_heads": 4, "patch_size": 14, "image_size": 56}, seed=3)
    save_vlm(other, processor, tmp_path)
    model, proc = load_vlm(str(tmp_path))
    assert model.config.text_config.hidden_size == 96 and model.config.vision_config.patch_size == 14
    ids, mm = proc.encode("is there a circle?", [picture(90)])  # resized to ~56² by its own processor
    assert mm.image_grid_thw.tolist() == [[1, 4, 4]] and ids.count(proc.image_token_id) == 4
    out = logits(model, proc, picture(90))
    assert out.shape[-1] == len(proc.tokenizer) and torch.isfinite(out).all()
