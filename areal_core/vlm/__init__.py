"""Vision-language models (docs/vlm.md): the tiny Qwen2.5-VL built in code, images stored
content-addressed under the run root, and the multimodal inputs (pixel values,
image grids, mrope positions) that the engines and the trainer rebuild from a row's image ids.

Rows never hold pixels: a sample names its images by sha256 (`Sample.image_ids`), and every
consumer turns them back into model inputs with the model's own image processor
(`areal_core.vlm_processor.VisionProcessor`, beside models.py).
"""
