"""See inside a run: the store's events, trainer metrics and audit records turned into series
(series.py), a bottleneck verdict (doctor.py) and one self-contained HTML page (html.py), opened
as `python -m areal_core.report RUN_URI`, as a Flyte Deck, or as an MLflow artifact.

Reads the store only; never imports flytekit.
"""
