"""Weight publication through the store: weights/v{N}/ in HF format + MANIFEST.json, then LATEST.

A version is visible only once its MANIFEST.json (sha256 of every file) and then LATEST
are written; loaders verify every checksum before trusting the bytes.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.store import Store, weights_dir

WEIGHTS_FILE = "model.safetensors"


class WeightsError(RuntimeError):
    """A published version that is missing, incomplete or fails its checksum."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hf_side_files(model, tokenizer) -> dict[str, bytes]:
    """config.json, generation config and tokenizer files: published once per run, reused per version."""
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def state_dict_bytes(model: torch.nn.Module) -> bytes:
    # Tied tensors (lm_head = embed_tokens) are stored once, as HF does.
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return st_save(sd, metadata={"format": "pt"})


def publish(store: Store, version: int, weights: bytes, side_files: dict[str, bytes]) -> float:
    """Write weights/v{version}/ whole, then MANIFEST.json, then LATEST. Returns seconds taken."""
    t0 = time.perf_counter()
    base = weights_dir(version)
    files = {WEIGHTS_FILE: weights, **side_files}
    for name, data in files.items():
        store.write_bytes(f"{base}/{name}", data)
    manifest = {"version": version, "files": {n: sha256(d) for n, d in files.items()}, "time": time.time()}
    store.write_json(f"{base}/MANIFEST.json", manifest)
    store.write_text("weights/LATEST", str(version))
    return time.perf_counter() - t0


def load_state_dict(store: Store, version: int) -> dict[str, torch.Tensor]:
    """The verified state dict of a published version; raises WeightsError."""
    base = weights_dir(version)
    try:
        manifest = store.read_json(f"{base}/MANIFEST.json")
        data = store.read_bytes(f"{base}/{WEIGHTS_FILE}")
    except FileNotFoundError as exc:
        raise WeightsError(f"weights v{version} incomplete: {exc}") from None
    except json.JSONDecodeError:
        raise WeightsError(f"weights v{version}: MANIFEST.json is not JSON") from None
    if sha256(data) != manifest["files"].get(WEIGHTS_FILE):
        raise WeightsError(f"weights v{version}: {WEIGHTS_FILE} fails its sha256 check")
    return st_load(data)


def prune(store: Store, keep_from: int) -> None:
    """Delete versions older than `keep_from` (never the one LATEST names)."""
    for name in store.listdir("weights"):
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep_from:
            store.delete(f"weights/{name}", recursive=True)
