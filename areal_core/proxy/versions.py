"""Where a serving proxy's versions come from (`python -m areal_core.proxy --follow SOURCE`).

A `VersionSource` names the version to serve now as weights/v{N} of a run-root-shaped store
(`store`: init_model/ + weights/), so the proxy's engine is built by the rollout factory
(`rollout/factory.build_engine`) and takes each new version the way a rollout worker does: the
one weight watcher (`weights/watcher.py`) polls `latest_version()` and hands N to
`engine.receive(store, N)`, which verifies it against its manifest. An in-process engine installs
it between two decode steps and re-prefills the rows in flight; a remote engine (vLLM, SGLang)
pauses its server, reloads and re-submits what the pause aborted. Every token records the version
that sampled it, and no request fails because a version changed.

    models:/NAME@ALIAS   MlflowAlias  the alias, polled; each registered version it moves to,
                                      forwards or back, becomes the next serving version N of a
                                      local serving store (a rollback is a new N with old weights)
    RUN/weights          RunWeights   the trainer's published versions as they are: N is the
                                      trainer's version, the one the staleness bound counts
    DIR                  Folder       one HF folder, fixed at N = `version` (today's proxy)

Serving versions only grow, so the engines' rule (install only what is newer) holds through a
rollback; `label(N)` names what N holds (models:/NAME/3, RUN/weights/v000007, DIR), and /health
and every completion carry it (`Follower`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.weights import WEIGHTS_FILE, WeightsError, sha256
from areal_core.weights.faults import Reporter
from areal_core.weights.publisher import publish
from areal_core.weights.reader import forget, read_manifest
from areal_core.weights.watcher import WeightWatcher

log = logging.getLogger("areal.proxy")

_SKIP = (LAYOUT.manifest_name, LAYOUT.committed_name, "model.safetensors.index.json")


class SourceUnavailable(WeightsError):
    """The source cannot be read now (registry or store unreachable, a download cut short); the
    watcher logs it and asks again at the next poll, serving the version it has meanwhile."""


class VersionSource(ABC):
    """`store`: where weights/v{N} of every version named lives; `follows`: polled for new ones."""

    follows = True

    def __init__(self, spec: str, store: Store):
        self.spec, self.store = spec, store

    @abstractmethod
    def latest_version(self) -> int | None:
        """The serving version the source names now, ready as weights/v{N} of `store`; None: none
        yet. Raises SourceUnavailable when the source cannot be read now."""

    @abstractmethod
    def label(self, version: int) -> str:
        """What serving version `version` holds, in the source's own terms."""

    def close(self) -> None:  # noqa: B027 - most sources make nothing to release
        """Release what the source made (a serving store in a temporary folder)."""


def _folder_files(*folders: str | Path) -> dict[str, bytes]:
    """An HF folder's files for one version (a later folder's file of the same name wins):
    model.safetensors (shards merged) and the side files."""
    files = {}
    for root in map(Path, folders):
        files.update({p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and p.name not in _SKIP})
    folder = folders[0]
    shards = sorted(n for n in files if n.endswith(".safetensors") and n != WEIGHTS_FILE)
    if WEIGHTS_FILE not in files:
        if not shards:
            raise WeightsError(f"{folder}: no {WEIGHTS_FILE} (nor shards of it)")
        merged: dict[str, Any] = {}
        for name in shards:
            merged.update(st_load(files[name]))
        files[WEIGHTS_FILE] = st_save(merged, metadata={"format": "pt"})
    return {n: d for n, d in files.items() if n not in shards}


def install_files(store: Store, version: int, files: dict[str, bytes]) -> None:
    """Write `files` as weights/v{version} of `store` (MANIFEST.json, then LATEST), and as its
    init_model/ (what `build_engine` loads the architecture and tokenizer from) when it has none."""
    if not store.exists(LAYOUT.committed(LAYOUT.init_model)):
        for name, data in files.items():
            store.write_bytes(f"{LAYOUT.init_model}/{name}", data)
        store.write_json(LAYOUT.committed(LAYOUT.init_model), {"time": time.time()})
    side = {n: d for n, d in files.items() if n != WEIGHTS_FILE}
    publish(store, version, files[WEIGHTS_FILE], side)


def version_files(store: Store, version: int) -> dict[str, bytes]:
    """The files of weights/v{version}, each checked against its manifest (WeightsError if one fails)."""
    manifest = read_manifest(store, version)
    out = {}
    for name, digest in manifest["files"].items():
        data = store.read_bytes(LAYOUT.weights_file(version, name))
        if sha256(data) != digest:
            raise WeightsError(f"weights v{version}: {name} fails its sha256 check")
        out[name] = data
    return out


class _Serving(VersionSource):
    """A source whose versions are written into a serving store of its own (a local folder)."""

    def __init__(self, spec: str, staging: str = ""):
        self._owned = "" if staging else tempfile.mkdtemp(prefix="areal-serving-")
        super().__init__(spec, Store(staging or self._owned))
        self.labels: dict[int, str] = {}  # serving version -> what it holds

    def label(self, version: int) -> str:
        return self.labels.get(version, f"v{version}")

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self._owned, ignore_errors=True)


class Folder(_Serving):
    """One HF folder (local or fsspec URI), served as version `version` for good."""

    follows = False

    def __init__(self, spec: str, version: int = 0, staging: str = ""):
        super().__init__(spec, staging)
        self.version = version

    def latest_version(self) -> int:
        if self.version not in self.labels:
            from areal_core.models import localize

            install_files(self.store, self.version, _folder_files(localize(self.spec)))
            self.labels[self.version] = self.spec
        return self.version


class MlflowAlias(_Serving):
    """`models:/NAME@ALIAS` of the registry at `tracking_uri`, polled. Each registered version the
    alias moves to is downloaded once (`online/registry.download`) and becomes serving version
    current + 1 (the first: `first`, or after the serving store's LATEST); moving back to a version
    held here copies its verified files instead. The `keep` most recent distinct versions stay."""

    def __init__(self, spec: str, tracking_uri: str = "", staging: str = "", first: int = 0, keep: int = 4):
        super().__init__(spec, staging)
        name, sep, alias = spec.removeprefix("models:/").partition("@")
        if not (name and sep and alias) or "/" in name:
            raise ValueError(f"an MLflow alias source is models:/NAME@ALIAS, not {spec!r}")
        self.name, self.alias, self.keep = name, alias, keep
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        latest = self.store.latest_version()
        self.next = first if latest is None else max(first, latest + 1)
        self.current: int | None = None  # the serving version last named, and the registered one it holds
        self.current_registered = ""
        self.held: dict[str, int] = {}  # registered version -> the serving version holding it, oldest first

    def _aliased(self) -> str | None:
        """The registered version the alias names now (None: no such alias yet)."""
        import mlflow
        from mlflow.exceptions import MlflowException

        try:
            client = mlflow.MlflowClient(self.tracking_uri, self.tracking_uri)
            mv = client.get_model_version_by_alias(self.name, self.alias)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise SourceUnavailable(f"{self.spec}: the registry cannot be read: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - connection refused, timeouts: ask again at the next poll
            raise SourceUnavailable(f"{self.spec}: the registry cannot be read: {exc!r}") from None
        return str(mv.version)

    def latest_version(self) -> int | None:
        registered = self._aliased()
        if registered is None or registered == self.current_registered:
            return self.current
        uri = f"models:/{self.name}/{registered}"
        n = self.next
        files = self._held_files(registered)
        if files is None:
            t0 = time.time()
            files = self._download(uri)  # the version, not the alias: the alias may move again meanwhile
            log.info("%s: %s downloaded in %.1fs", self.spec, uri, time.time() - t0)
        install_files(self.store, n, files)
        old = self.held.pop(registered, None)
        self.held[registered] = n
        self.labels[n], self.current, self.current_registered, self.next = uri, n, registered, n + 1
        for stale in [old] + [self.held.pop(r) for r in list(self.held)[: max(0, len(self.held) - self.keep)]]:
            if stale is not None:
                self.store.delete(LAYOUT.weights_dir(stale), recursive=True)
        log.info("%s names %s: serving version %d", self.spec, uri, n)
        return n

    def _download(self, uri: str) -> dict[str, bytes]:
        """The files of registered version `uri`: the MLflow transformers model's model/ with its
        tokenizer (components/tokenizer/) merged in, as `online/registry.download` reads it."""
        import mlflow

        tmp = tempfile.mkdtemp(prefix="areal-registered-")
        try:
            where = {"tracking_uri": self.tracking_uri, "registry_uri": self.tracking_uri}
            root = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, **where))
            tokenizer = root / "components" / "tokenizer"
            return _folder_files(root / "model", *([tokenizer] if tokenizer.is_dir() else []))
        except WeightsError:
            raise
        except Exception as exc:  # noqa: BLE001 - a registry outage or a cut download: asked again at the next poll
            raise SourceUnavailable(f"{self.spec}: downloading {uri} failed: {exc!r}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _held_files(self, registered: str) -> dict[str, bytes] | None:
        """The files of the serving version that holds `registered` already, checked; None if none."""
        held = self.held.get(registered)
        if held is None:
            return None
        try:
            return version_files(self.store, held)
        except (WeightsError, FileNotFoundError) as exc:
            log.warning("%s: the copy of %s held here is unusable (%s): downloading it", self.spec, registered, exc)
            return None


class RunWeights(VersionSource):
    """RUN/weights: the versions a run's trainer publishes, served under their own numbers."""

    def __init__(self, spec: str):
        super().__init__(spec, Store(spec.rstrip("/").removesuffix(LAYOUT.weights_root).rstrip("/")))

    def latest_version(self) -> int | None:
        try:  # the store retries transient errors; one that lasts is retried at the next poll
            return self.store.latest_version()
        except Exception as exc:  # noqa: BLE001
            raise SourceUnavailable(f"{self.spec}: LATEST cannot be read: {exc!r}") from None

    def label(self, version: int) -> str:
        return self.store.url(LAYOUT.weights_dir(version))


def make_source(spec: str, *, tracking_uri: str = "", staging: str = "", version: int = 0) -> VersionSource:
    """The source `spec` names: models:/NAME@ALIAS, a path ending in /weights, or an HF folder."""
    if spec.startswith("models:/"):
        return MlflowAlias(spec, tracking_uri, staging, first=version)
    if spec.rstrip("/").rsplit("/", 1)[-1] == LAYOUT.weights_root:
        return RunWeights(spec)
    return Folder(spec, version, staging)


def first_version(source: VersionSource, timeout_s: float = 600.0, poll_s: float = 0.5) -> int:
    """Block until the source names a version (a run's trainer has published, the alias exists)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            v = source.latest_version()
            if v is not None:
                return v
        except SourceUnavailable as exc:
            log.warning("%s", exc)
        if time.time() > deadline:
            raise TimeoutError(f"{source.spec} named no version in {timeout_s:.0f}s")
        time.sleep(poll_s)


class Follower:
    """`engine` following `source`: the weight watcher delivers each newer serving version N
    (`engine.receive(source.store, N)`: verified, staged, installed at the engine's next step).
    `describe()` is /health's `serving` entry; `label(N)` names what N holds."""

    def __init__(self, source: VersionSource, engine: Any, poll_interval_s: float = 5.0, worker_id: str = ""):
        self.source, self.engine = source, engine
        self.delivered: list[dict[str, Any]] = []  # the versions handed to the engine, in order
        # a proxy following a run's weights reports a version it cannot load to that run's trainer
        # (weights/faults.py), which republishes it, or retires the proxy (it stops following, and
        # /health says ok false) when the version verifies in the store and only this proxy fails it
        run = isinstance(source, RunWeights) and worker_id
        self.faults = Reporter(source.store, worker_id, self._restart, self._retired) if run else None
        on_failure = self.faults.failed if self.faults is not None else None
        # the watcher reads only `latest_version()`, which every source has
        self.watcher = WeightWatcher(
            source,  # type: ignore[arg-type]
            self._receive,
            poll_interval_s,
            version=engine.version,
            on_failure=on_failure,
        )

    def _receive(self, version: int) -> None:
        self.engine.receive(self.source.store, version)
        if self.faults is not None:
            self.faults.loaded()
        entry = {"version": version, "model_version": self.label(version), "time": time.time()}
        self.delivered = [*self.delivered[-15:], entry]  # one assignment: /health reads it from another thread

    def _restart(self) -> None:
        forget(self.source.store)
        clear = getattr(self.engine, "clear_weight_cache", None)
        if clear is not None:
            clear()

    def _retired(self) -> None:
        """Called on the watcher's thread: it stops after this poll."""
        self.watcher.halt()
        self.faults.retire(0)  # type: ignore[union-attr]

    def start(self) -> Follower:
        if self.source.follows:
            self.watcher.start()
        return self

    def stop(self) -> None:
        self.watcher.stop()
        self.source.close()

    def label(self, version: int) -> str:
        return self.source.label(version)

    def healthy(self) -> bool:
        """False once the watcher stopped on an error (e.g. the engine failed to load a version) or
        the run's trainer retired this proxy."""
        return self.watcher.error is None and (self.faults is None or self.faults.retired is None)

    def describe(self) -> dict[str, Any]:
        v = self.engine.version
        return {
            "source": self.source.spec,
            "version": v,
            "model_version": self.label(v),
            "following": self.source.follows and self.watcher.alive(),
            "error": None if self.watcher.error is None else repr(self.watcher.error),
            "retired": self.faults is not None and self.faults.retired is not None,
            "delivered": self.delivered[-4:],
        }
