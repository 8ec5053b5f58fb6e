"""Dataset loaders and the embedded synthetic task.

Every loader returns prompt records: dicts with `prompt_id`, `prompt` (the question),
`answer` (a GSM8K-style worked solution ending in `#### <number>`) and `meta`.

Note: this top-level package shadows Hugging Face's `datasets` inside this project's
environment; nothing here uses that library.
"""

from datasets.registry import load_task

__all__ = ["load_task"]
