"""Multimodal model inputs rebuilt from image ids: pixel values, image grids and mrope positions.

Qwen2.5-VL places a prompt's vision tokens on a (time, height, width) grid of rotary positions
and the text after them on one line that continues past the grid (`get_rope_index`). The
trainer's forward passes and the engine's prefill both take those positions from the model's
own `get_rope_index` over the unpadded tokens, so a row gets the same positions whether it is
left-padded (engine) or right-padded (trainer); decode steps continue each row's line by one.

    rows = MultimodalRows.from_samples(samples, processor, ImageCache([store]))
    logp = token_logprobs(model, ids, attn, **rows.model_inputs(model, None, ids, attn))   # trainer

    vision = VisionPrompts(processor.image_token_id, [mm_a, mm_b])                          # engine
    model(input_ids=seq, attention_mask=mask, **vision.inputs(model, seq, mask, prefill=True))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from areal_core.vlm.images import ImageCache
from areal_core.vlm.model import MMInputs, VisionProcessor


def _vl_model(model: Any) -> Any:
    """The module that has `get_rope_index` (Qwen2_5_VLModel), through wrappers (LoRA, FSDP)."""
    for candidate in (model, getattr(model, "model", None), getattr(getattr(model, "base_model", None), "model", None)):
        inner = getattr(candidate, "model", None)
        if inner is not None and hasattr(inner, "get_rope_index"):
            return inner
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    raise TypeError(f"{type(model).__name__} is not a Qwen2.5-VL model (no get_rope_index)")


VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(config: Any) -> tuple[int, ...]:
    """A VLM config's placeholder tokens (image/video pad, vision start/end): prompt-only. The engine
    never samples them and the trainer's log-probs use the same masked distribution; a tiny
    untrained model would otherwise emit an image pad that `get_rope_index` takes for an image."""
    ids = (getattr(config, k, None) for k in VISION_TOKEN_KEYS)
    return tuple(sorted({int(i) for i in ids if i is not None}))


def mask_vision_logits(logits: torch.Tensor, banned: tuple[int, ...]) -> torch.Tensor:
    """logits with the vision placeholders at -inf: π(x) = 0 for x in `banned`, renormalised by softmax."""
    if not banned:
        return logits
    return logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))


def rope_positions(
    model: Any, ids: torch.Tensor, attn: torch.Tensor, grid: torch.Tensor | None, image_token_id: int
) -> torch.Tensor:
    """mrope position ids [3, B, L] of padded rows `ids` (pad positions 0), the images' grids in
    row order; rows without images get 0, 1, 2, ... on all three axes."""
    types = (ids == image_token_id).int()
    if grid is None or not len(grid):
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        return pos[None].expand(3, -1, -1).clone()
    pos, _ = _vl_model(model).get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grid.to(ids.device), attention_mask=attn
    )
    return pos


def _vision_kwargs(mm: MMInputs | None, model: Any) -> dict[str, torch.Tensor]:
    if mm is None:
        return {}
    param = next(model.parameters())
    return {
        "pixel_values": mm.pixel_values.to(param.device, param.dtype),
        "image_grid_thw": mm.image_grid_thw.to(param.device),
    }


def pad_runs(ids: Sequence[int], pad: int) -> list[int]:
    """Lengths of the runs of `pad` in `ids`, in order."""
    runs, n = [], 0
    for t in (*ids, None):
        if t == pad:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


class PlaceholderCheck:
    """Why a sample's image pads do not stand for its images (None when they do): one run per
    image, each as long as that image's merged patches (`get_rope_index` and the model's
    placeholder mask would fail on the rest). Each prompt's images are processed once."""

    def __init__(self, processor: VisionProcessor, images: ImageCache):
        self.processor, self.images = processor, images
        self._want: dict[tuple[str, ...], list[int]] = {}

    def __call__(self, sample: Any) -> str | None:
        runs = pad_runs(sample.input_ids, self.processor.image_token_id)
        key = tuple(sample.image_ids or ())
        if key not in self._want:
            grid = self.processor.pixels(self.images.load(list(key))).image_grid_thw if key else torch.zeros(0, 3)
            self._want[key] = self.processor.image_tokens(grid)
        if runs != self._want[key]:
            return f"sample {sample.sample_id}: image pad runs {runs[:8]} do not match its images' {self._want[key]}"
        return None


class MultimodalRows:
    """The images of a training batch's rows (row i: samples[i]) as model inputs for any subset of rows."""

    def __init__(self, per_row: Sequence[MMInputs | None], image_token_id: int):
        self.per_row, self.image_token_id = list(per_row), image_token_id

    @classmethod
    def from_samples(cls, samples: Sequence[Any], processor: VisionProcessor, images: ImageCache) -> MultimodalRows:
        """Each sample's `image_ids` loaded (checked against their ids) and processed once per prompt."""
        built: dict[tuple[str, ...], MMInputs | None] = {}
        per_row = []
        for s in samples:
            key = tuple(s.image_ids or ())
            if key not in built:
                built[key] = processor.pixels(images.load(list(key))) if key else None
            per_row.append(built[key])
        return cls(per_row, processor.image_token_id)

    def model_inputs(
        self, model: Any, rows: torch.Tensor | None, ids: torch.Tensor, attn: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """forward() keyword arguments for `rows` of the batch (all when None), whose padded
        tokens are `ids` / `attn`: pixel values, image grids, mrope position ids."""
        idx = range(len(self.per_row)) if rows is None else rows.tolist()
        mm = MMInputs.cat([self.per_row[i] for i in idx])
        grid = None if mm is None else mm.image_grid_thw
        return {
            "position_ids": rope_positions(model, ids, attn, grid, self.image_token_id),
            **_vision_kwargs(mm, model),
        }


class VisionPrompts:
    """The engine's side: one prompt's MMInputs (or None) per batch row. The prefill (and every
    re-prefill after a weight swap) gets the pixel values and the rows' mrope positions; each
    decode step gets the next position of every row's text line."""

    def __init__(self, image_token_id: int, per_row: Sequence[MMInputs | None]):
        self.image_token_id, self.per_row = image_token_id, list(per_row)
        self.next: torch.Tensor | None = None  # [B]: the position of each row's next token

    def inputs(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, prefill: bool) -> dict[str, torch.Tensor]:
        if prefill:
            mm = MMInputs.cat(self.per_row)
            pos = rope_positions(model, ids, mask, None if mm is None else mm.image_grid_thw, self.image_token_id)
            self.next = pos.amax(dim=(0, 2)) + 1
            return {"position_ids": pos, **_vision_kwargs(mm, model)}
        if self.next is None:
            raise RuntimeError("a decode step before the prefill")
        step = self.next[None, :, None].expand(3, -1, ids.shape[1]).clone()
        self.next = self.next + ids.shape[1]
        return {"position_ids": step}
