"""Task data: the loaders of every `task.name` (registry.py), the tables users bring (tables.py,
formats.py: docs/data.md) and the embedded synthetic tasks.

Every loader returns prompt records: dicts with `prompt_id`, `prompt` (the question),
`answer` (the SFT demonstration and the reward's reference) and `meta`.

Named task_data, not datasets, so that Hugging Face's `datasets` stays importable beside it
(a `task.loader` plug-in may build its records with that library).
"""

from task_data.registry import load_run_task, load_task

__all__ = ["load_run_task", "load_task"]
