"""The weight transport: how a trained version travels from the trainer to the rollout engines.

    publisher.py  the trainer writes weights/v{N}/ (HF files, or a delta) + MANIFEST.json, then LATEST
    reader.py     verified reading: every file against its manifest sha256, delta chains rebuilt,
                  staging on local disk for servers that load from a folder (vLLM, SGLang)
    watcher.py    one thread that polls LATEST and hands each newer version to a callback
    delta.py      the bit-exact delta codec between consecutive safetensors files

A version is visible only once its MANIFEST.json (sha256 of every file) and then LATEST are
written; readers verify every checksum before trusting the bytes.
"""

from __future__ import annotations

import hashlib

WEIGHTS_FILE = "model.safetensors"
DELTA_FILE = "model.delta"  # delta publication: the change against the previous version


class WeightsError(RuntimeError):
    """A published version that is missing, incomplete or fails its checksum."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
