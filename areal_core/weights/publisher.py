"""Weight publication through the store: weights/v{N}/ in HF format + MANIFEST.json, then LATEST.

Delta publication (`WeightPublisher(delta=True)`, `train.weight_delta`): version N is stored as
`model.delta` against version N-1 instead of `model.safetensors`, with a full snapshot whenever
N is a multiple of `full_every` (and after any gap, e.g. a trainer restart). The delta
(`delta.py`) is the element-wise integer difference of the raw bits of consecutive
safetensors files (zigzag coded, split into byte planes, zstd or zlib compressed): bit-exact,
and the high bytes of a small optimizer update are mostly zero. An unchanged tensor costs next
to nothing. The manifest's `weights` entry names the base version, the codec and the sha256 of
the rebuilt model.safetensors; a reader (`reader.py`) rebuilds full snapshot + deltas in order
and checks that sha256, so what it loads is bit for bit what a full publication holds.

Versions can be published in bfloat16 (`dtype`, train.weight_dtype) from the trainer's fp32 master
weights: half the bytes, and at RL learning rates most bf16 values do not change from one step to
the next, so a delta of two bf16 versions is mostly zeros (docs/benchmarks.md, "bf16 deltas").
`published_dtype(cfg)` resolves "auto": bfloat16 where the engines load bfloat16 (rollout.dtype
bfloat16, or a server engine whose server.dtype is bfloat16), else float32, so a float32 engine
keeps loading exactly the trainer's weights. Checkpoints always hold the fp32 master.

LoRA runs publish only the adapter (`publish_adapter`, `adapter.py`): a few MB per version
instead of the whole model; readers merge it into the run's init_model.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.config.run import is_remote_engine
from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, sha256
from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from areal_core.weights.delta import encode_delta
from areal_core.weights.reader import delta_base


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
        for key in [k for k in sd if k == "lm_head.weight" or k.endswith(".lm_head.weight")]:
            sd.pop(key)  # also a LoRA-wrapped model's base_model.model.lm_head.weight
    return st_save(sd, metadata={"format": "pt"})


def published_dtype(cfg) -> str:
    """train.weight_dtype, "auto" resolved (module docstring)."""
    chosen = cfg.train.weight_dtype
    if chosen != "auto":
        return chosen
    server = is_remote_engine(cfg.rollout.engine)
    engine = str(cfg.rollout.server.dtype if server else cfg.rollout.dtype)
    return "bfloat16" if engine in ("bfloat16", "bf16") else "float32"


def cast_safetensors(blob: bytes, dtype: str) -> bytes:
    """The safetensors `blob` with its floating-point tensors in `dtype` (round to nearest even)."""
    if dtype == "float32":
        return blob
    target = getattr(torch, dtype)
    sd = st_load(blob)
    return st_save({k: v.to(target) if v.is_floating_point() else v for k, v in sd.items()}, metadata={"format": "pt"})


def _write_version(store: Store, version: int, files: dict[str, bytes], weights_info: dict | None) -> None:
    for name, data in files.items():
        store.write_bytes(LAYOUT.weights_file(version, name), data)
    manifest: dict[str, Any] = {"version": version, "files": {n: sha256(d) for n, d in files.items()}}
    manifest["time"] = time.time()
    if weights_info is not None:
        manifest["weights"] = weights_info
    store.write_json(LAYOUT.manifest(version), manifest)
    store.write_text(LAYOUT.latest, str(version))


def publish(store: Store, version: int, weights: bytes, side_files: dict[str, bytes]) -> float:
    """Write weights/v{version}/ whole, then MANIFEST.json, then LATEST. Returns seconds taken."""
    t0 = time.perf_counter()
    _write_version(store, version, {WEIGHTS_FILE: weights, **side_files}, None)
    return time.perf_counter() - t0


class WeightPublisher:
    """The trainer's publisher: full versions, or (`delta`) deltas against the previous version
    with a full snapshot when the version is a multiple of `full_every`, after a gap in the
    numbering (the first publish of a process) and when the layout changes.

    Holds the previous version's bytes (delta mode only). `last_weights_bytes` is the size of the
    weights file the last publish wrote. `dtype`: the published tensors' (weights given in fp32 are
    cast; the checksum is of the cast file).
    """

    def __init__(
        self,
        store: Store,
        side_files: dict[str, bytes],
        delta: bool = False,
        full_every: int = 8,
        dtype: str = "float32",
    ):
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.store, self.side_files, self.delta, self.full_every = store, side_files, delta, full_every
        self.dtype = dtype
        self._prev: tuple[int, bytes] | None = None
        self.last_weights_bytes = 0

    def publish(self, version: int, weights: bytes | dict[str, bytes]) -> float:
        """Publish `weights` (safetensors bytes, or a LoRA adapter's files) as `version` (write files,
        MANIFEST.json, LATEST). Returns seconds taken."""
        if isinstance(weights, dict):
            return self.publish_adapter(version, weights)
        t0 = time.perf_counter()
        weights = cast_safetensors(weights, self.dtype)
        if not self.delta:
            self.last_weights_bytes = len(weights)
            publish(self.store, version, weights, self.side_files)
            return time.perf_counter() - t0
        prev, self._prev = self._prev, None
        enc = None
        if prev is not None and prev[0] == version - 1 and version % self.full_every:
            enc = encode_delta(prev[1], weights)
        if enc is None:
            name, data, info = WEIGHTS_FILE, weights, {"base": None}
        else:
            (data, info), name = enc, DELTA_FILE
            info["base"] = version - 1
        info["sha256"] = sha256(weights)
        _write_version(self.store, version, {name: data, **self.side_files}, info)
        self._prev = (version, weights)
        self.last_weights_bytes = len(data)
        return time.perf_counter() - t0

    def republish(self, version: int, weights: bytes | dict[str, bytes]) -> float:
        """Publish `version` again, whole (no delta base): a repair of a version readers cannot load
        (weights/faults.py). The next version may be a delta against it."""
        self._prev = None
        seconds = self.publish(version, weights)
        listed = set(self.store.read_json(LAYOUT.manifest(version))["files"])
        for name in self.store.listdir(LAYOUT.weights_dir(version)):  # e.g. the delta it replaced
            if name not in listed and name != LAYOUT.manifest_name:
                self.store.delete(LAYOUT.weights_file(version, name))
        return seconds

    def publish_adapter(self, version: int, files: dict[str, bytes]) -> float:
        """Publish a LoRA adapter (`adapter.ADAPTER_WEIGHTS`, `ADAPTER_CONFIG`) as `version`. Returns seconds taken."""
        if set(files) != {ADAPTER_WEIGHTS, ADAPTER_CONFIG}:
            raise ValueError(f"an adapter version is {ADAPTER_WEIGHTS} + {ADAPTER_CONFIG}, got {sorted(files)}")
        t0 = time.perf_counter()
        _write_version(self.store, version, {**files, **self.side_files}, None)
        self._prev = None
        self.last_weights_bytes = sum(len(d) for d in files.values())
        return time.perf_counter() - t0


def prune(store: Store, keep_from: int) -> None:
    """Delete versions older than `keep_from`, except the full snapshot and deltas that the oldest
    kept version is rebuilt from (a delta's base is always the version before it)."""
    versions = sorted(v for n in store.listdir(LAYOUT.weights_root) if (v := LAYOUT.weights_version(n)) is not None)
    kept = [v for v in versions if v >= keep_from]
    v = kept[0] if kept else -1
    while v >= 0:
        try:
            base = delta_base(store.read_json(LAYOUT.manifest(v)))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            break
        if not isinstance(base, int) or base >= v:
            break
        keep_from, v = min(keep_from, base), base
    for v in versions:
        if v < keep_from:
            store.delete(LAYOUT.weights_dir(v), recursive=True)
