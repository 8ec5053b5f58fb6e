"""The verified reader of published weight versions.

Every file is checked against the sha256 its version's MANIFEST.json records before it is
trusted. A delta-published version is rebuilt from the newest full snapshot (or bytes of an
older version already verified here) and the deltas after it, and the rebuilt
model.safetensors is checked against the sha256 the manifest records for it, so what a reader
gets is bit for bit what a full publication of the same weights holds.

Ways out: `load_state_dict` (in-process engines: a state dict to swap between decode steps),
`stage_verified` (servers that load an HF folder from their own disk, vLLM and SGLang: the
version is copied to a local staging folder, written under a temporary name and renamed only
once every file matched, so a server never loads bytes that failed their check), and for a
server with native LoRA (vLLM loads an adapter by path) `stage_adapter` and `stage_base` (the
adapter of a LoRA version and the run's init_model, checked and staged the same way).

A LoRA version (`adapter.py`: the adapter files instead of model.safetensors) is merged into the
run's init_model here: `load_state_dict` gives the merged adapted weights (all an engine holding
the base model needs), `stage_verified` a whole merged model.safetensors for the server.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.store import Store, UnreadableObject
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, WeightsError, sha256
from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_deltas, lora_scale, merged_weights
from areal_core.weights.delta import decode_delta

MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a few files and their digests


def read_manifest(store: Store, version: int) -> dict[str, Any]:
    """The manifest of a published version; WeightsError if it is missing or malformed."""
    try:
        manifest = json.loads(store.read_bytes(LAYOUT.manifest(version), MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        raise WeightsError(f"weights v{version} incomplete: no {LAYOUT.manifest_name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, UnreadableObject):
        raise WeightsError(f"weights v{version}: {LAYOUT.manifest_name} is not JSON of a sane size and depth") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not {WEIGHTS_FILE, DELTA_FILE, ADAPTER_WEIGHTS} & set(files):
        raise WeightsError(f"weights v{version}: {LAYOUT.manifest_name} lists no {WEIGHTS_FILE}")
    if ADAPTER_WEIGHTS in files and ADAPTER_CONFIG not in files:
        raise WeightsError(f"weights v{version}: {LAYOUT.manifest_name} lists no {ADAPTER_CONFIG}")
    if manifest.get("version") != version:
        raise WeightsError(f"weights v{version}: {LAYOUT.manifest_name} names version {manifest.get('version')!r}")
    return manifest


def delta_base(manifest: dict[str, Any]) -> int | None:
    """The version a delta-published version is stored against; None for a full version."""
    info = manifest.get("weights")
    return info.get("base") if isinstance(info, dict) else None


def read_version_file(store: Store, version: int, manifest: dict[str, Any], name: str) -> bytes:
    """File `name` of weights/v{version}, checked against `manifest` (WeightsError if missing or failing)."""
    try:
        data = store.read_bytes(LAYOUT.weights_file(version, name))
    except FileNotFoundError:
        raise WeightsError(f"weights v{version} incomplete: {name} is missing") from None
    except UnreadableObject as exc:
        raise WeightsError(f"weights v{version}: {exc}") from None
    if sha256(data) != manifest["files"].get(name):
        raise WeightsError(f"weights v{version}: {name} fails its sha256 check")
    return data


def load_weights_bytes(store: Store, version: int, have: tuple[int, bytes] | None = None) -> bytes:
    """The verified model.safetensors bytes of a published version: read whole, or rebuilt from the
    newest full snapshot (or `have`, verified bytes of an older version) and the deltas after it.
    Raises WeightsError naming the version and file that is missing or fails its check."""
    return _load(store, version, have)[0]


def _load(store: Store, version: int, have: tuple[int, bytes] | None) -> tuple[bytes, bool]:
    """(bytes, whether the version was delta-published: a full snapshot or a delta)."""
    chain: list[tuple[int, dict[str, Any]]] = []  # delta versions, newest first
    v, manifest = version, read_manifest(store, version)
    delta_run = "weights" in manifest
    while True:
        base = delta_base(manifest)
        if base is None:
            data = read_version_file(store, v, manifest, WEIGHTS_FILE)
            break
        if not isinstance(base, int) or not 0 <= base < v:
            raise WeightsError(f"weights v{v}: {LAYOUT.manifest_name} names a bad delta base {base!r}")
        chain.append((v, manifest))
        if have is not None and have[0] == base:
            data = have[1]
            break
        try:
            v, manifest = base, read_manifest(store, base)
        except WeightsError as exc:
            raise WeightsError(f"weights v{version}: cannot rebuild from delta base v{base}: {exc}") from None
    for v, manifest in reversed(chain):
        payload = read_version_file(store, v, manifest, DELTA_FILE)
        info = manifest["weights"]
        try:
            data = decode_delta(data, payload, info)
        except Exception as exc:  # noqa: BLE001 - a malformed delta or a codec error
            raise WeightsError(f"weights v{v}: {DELTA_FILE} does not apply to v{info['base']}: {exc}") from None
        if sha256(data) != info.get("sha256"):
            raise WeightsError(f"weights v{v}: {WEIGHTS_FILE} rebuilt from {DELTA_FILE} fails its sha256 check")
    return data, delta_run


_last_loaded: dict[str, tuple[int, bytes]] = {}  # store uri -> newest delta-run version loaded here
_last_lock = threading.Lock()


def is_adapter(manifest: dict[str, Any]) -> bool:
    return ADAPTER_WEIGHTS in manifest["files"]


_bases: dict[str, dict[str, torch.Tensor]] = {}  # store uri -> init_model tensors (LoRA runs)


def base_tensors(store: Store) -> dict[str, torch.Tensor]:
    """The tensors of the run's init_model (the base of LoRA versions), read once per store."""
    with _last_lock:
        if store.uri in _bases:
            return _bases[store.uri]
    if not store.exists(LAYOUT.committed(LAYOUT.init_model)):
        raise WeightsError(f"a LoRA version needs its base, and {LAYOUT.init_model} is not committed")
    tensors: dict[str, torch.Tensor] = {}
    for rel in sorted(store.find(LAYOUT.init_model, ".safetensors")):
        tensors.update(st_load(store.read_bytes(rel)))
    with _last_lock:
        return _bases.setdefault(store.uri, tensors)


def forget(store: Store) -> None:
    """Drop what this process keeps of `store`'s weights (the newest delta-run version loaded, the
    LoRA base): a reader restarting its loader (weights/faults.py) reads everything again."""
    with _last_lock:
        _last_loaded.pop(store.uri, None)
        _bases.pop(store.uri, None)


_model_bases: dict[str, Any] = {}  # store uri -> init_model loaded by transformers (its own parameter names)


def base_model(store: Store) -> Any:
    """The run's init_model as transformers loads it, read once per store: the base of adapters whose
    weights the checkpoint names otherwise (transformers 5 fuses MoE experts saved per expert)."""
    from areal_core.models import load_pretrained

    with _last_lock:
        if store.uri in _model_bases:
            return _model_bases[store.uri]
    model = load_pretrained(store.url(LAYOUT.init_model), tokenizer=False)[0]  # weights: no tokenizer
    with _last_lock:
        return _model_bases.setdefault(store.uri, model)


def _adapter_files(store: Store, version: int, manifest: dict[str, Any]) -> dict[str, bytes]:
    return {n: read_version_file(store, version, manifest, n) for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}


def _merged(store: Store, version: int, files: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], bool]:
    """(adapted weights merged into the base, in the model's own names; whether the checkpoint's
    tensors hold them under those names): from init_model's tensors, else from its loaded model
    (fused experts), cast back to the dtype the checkpoint stores."""
    try:
        names = set(adapter_deltas(files))
        tensors = base_tensors(store)
        if names <= set(tensors):
            return merged_weights(tensors, files), True
        model = base_model(store)
        stored = getattr(model, "stored_dtype", torch.float32)
        base = {k: v.to(stored) for k, v in model.state_dict().items() if k in names}
        return merged_weights(base, files), False
    except Exception as exc:  # noqa: BLE001 - a malformed adapter file or config, or a shape mismatch
        raise WeightsError(f"weights v{version}: the adapter does not apply to {LAYOUT.init_model}: {exc}") from None


def _adapter_weights(store: Store, version: int, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _merged(store, version, _adapter_files(store, version, manifest))[0]


def _write_merged_checkpoint(store: Store, version: int, manifest: dict[str, Any], folder: Path) -> None:
    """init_model with the adapter merged in, as a whole checkpoint in `folder`: the base tensors
    with the merged ones replaced or, where the checkpoint names the adapted weights otherwise, the
    loaded base model with them installed, saved by transformers (which writes its checkpoint names)."""
    from areal_core.models import save_pretrained

    merged, same_names = _merged(store, version, _adapter_files(store, version, manifest))
    if same_names:
        (folder / WEIGHTS_FILE).write_bytes(st_save({**base_tensors(store), **merged}, metadata={"format": "pt"}))
        return
    model = copy.deepcopy(base_model(store))
    model.load_state_dict(merged, strict=False)
    save_pretrained(model, None, folder, dtype=getattr(model, "stored_dtype", None))


def load_state_dict(store: Store, version: int) -> dict[str, torch.Tensor]:
    """The verified state dict of a published version; raises WeightsError.

    A LoRA version gives only the adapted weights, merged into the base (`adapter.py`). In a
    delta-published run the verified bytes of the newest version loaded (per store) are kept, so
    the next version costs one delta instead of a rebuild from the full snapshot."""
    manifest = read_manifest(store, version)
    if is_adapter(manifest):
        return _adapter_weights(store, version, manifest)
    with _last_lock:
        have = _last_loaded.get(store.uri)
    data, delta_run = _load(store, version, have)
    if delta_run:
        with _last_lock:
            if version > _last_loaded.get(store.uri, (-1, b""))[0]:
                _last_loaded[store.uri] = (version, data)
    with _safetensors_errors(f"weights v{version}: {WEIGHTS_FILE}"):
        return st_load(data)


@contextlib.contextmanager
def _safetensors_errors(what: str) -> Iterator[None]:
    """safetensors' own errors (e.g. a header that claims more bytes than the file holds) as WeightsError."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - SafetensorError, or any error of a malformed header
        raise WeightsError(f"{what} is not a valid safetensors file: {str(exc)[:200]}") from None


# -- staging on local disk, for servers that load a folder ---------------------------------------
def stage_verified(store: Store, version: int, staging_root: str | Path) -> Path:
    """Copy weights/v{version}/ to `staging_root/v{version:06d}` with every file's sha256 checked.

    Returns the staged folder (an HF checkpoint: safetensors, config, tokenizer files). A
    delta-published version is staged as its rebuilt, checked model.safetensors. Raises
    WeightsError, leaving nothing staged, when a file is missing or fails its check.
    """
    manifest = read_manifest(store, version)
    root = Path(staging_root)
    final = root / f"v{version:06d}"
    if (final / LAYOUT.manifest_name).is_file():
        return final  # staged and verified before
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        for name in sorted(manifest["files"]):
            if not name or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
                raise WeightsError(f"weights v{version}: {LAYOUT.manifest_name} names an unsafe file {name!r}")
            if name == DELTA_FILE:  # rebuilt, every file checked: from the staged base or the full snapshot
                (tmp / WEIGHTS_FILE).write_bytes(_rebuild(store, version, manifest, root))
                continue
            if name == ADAPTER_CONFIG:
                continue
            if name == ADAPTER_WEIGHTS:  # a whole checkpoint: init_model with the adapter merged in
                _write_merged_checkpoint(store, version, manifest, tmp)
                continue
            (tmp / name).write_bytes(read_version_file(store, version, manifest, name))
            if name.endswith(".safetensors"):  # the header parses and fits the file, as the server will need
                with _safetensors_errors(f"weights v{version}: {name}"), safe_open(str(tmp / name), "pt") as f:
                    list(f.keys())
        (tmp / LAYOUT.manifest_name).write_text(json.dumps(manifest))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def stage_adapter(store: Store, version: int, staging_root: str | Path) -> Path:
    """Copy a LoRA version's adapter (adapter_model.safetensors + adapter_config.json, sha256 checked,
    the config parsed) to `staging_root/v{version:06d}`, for a server that loads adapters by path
    (vLLM's native LoRA). Raises WeightsError, leaving nothing staged, when the version is not an
    adapter or a file is missing, fails its check or is malformed."""
    manifest = read_manifest(store, version)
    if not is_adapter(manifest):
        raise WeightsError(f"weights v{version} is not a LoRA adapter version (it holds no {ADAPTER_WEIGHTS})")
    root = Path(staging_root)
    final = root / f"v{version:06d}"
    if (final / LAYOUT.manifest_name).is_file() and (final / ADAPTER_WEIGHTS).is_file():
        return final
    files = {n: read_version_file(store, version, manifest, n) for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    try:
        lora_scale(json.loads(files[ADAPTER_CONFIG]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise WeightsError(f"weights v{version}: {ADAPTER_CONFIG} is malformed: {exc}") from None
    files[LAYOUT.manifest_name] = json.dumps(manifest).encode()
    _commit_folder(root, final, files)
    return final


def stage_base(store: Store, staging_root: str | Path) -> Path:
    """Copy the run's init_model (the base of LoRA versions) to `staging_root/base`, checked against
    its MANIFEST.json when it has one (as `models.load_pretrained` does); WeightsError when it is not
    committed or fails its check."""
    from areal_core.manifest import ManifestError, verify_local_dir

    root = Path(staging_root)
    final = root / "base"
    if final.is_dir():  # renamed into place only once checked
        return final
    if not store.exists(LAYOUT.committed(LAYOUT.init_model)):
        raise WeightsError(f"a LoRA run needs its base, and {LAYOUT.init_model} is not committed")
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    try:
        store.get_dir(LAYOUT.init_model, tmp)
        try:
            verify_local_dir(tmp)
        except ManifestError as exc:
            raise WeightsError(f"{LAYOUT.init_model}: {exc}") from None
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _commit_folder(root: Path, final: Path, files: dict[str, bytes]) -> None:
    """Write `files` under a temporary name in `root` and rename it to `final` once all are written."""
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _rebuild(store: Store, version: int, manifest: dict, root: Path) -> bytes:
    """model.safetensors of a delta-published version, from the base version's staged file when it
    is still staged (one delta to apply), else from the store's full snapshot and deltas."""
    base = delta_base(manifest)
    staged = root / f"v{base:06d}" if isinstance(base, int) else None
    if staged is not None and (staged / LAYOUT.manifest_name).is_file() and (staged / WEIGHTS_FILE).is_file():
        try:
            return load_weights_bytes(store, version, have=(base, (staged / WEIGHTS_FILE).read_bytes()))
        except WeightsError:
            pass  # a staged file that does not rebuild this version: from the store alone
    return load_weights_bytes(store, version)


def prune_staged(staging_root: str | Path, keep: set[int]) -> None:
    """Remove staged versions not in `keep`."""
    root = Path(staging_root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        name = path.name
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) not in keep:
            shutil.rmtree(path, ignore_errors=True)
