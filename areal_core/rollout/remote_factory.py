"""Remote engines for the rollout worker: `rollout.engine=vllm` or `sglang` (`rollout.server.*`).

The worker keeps its loop; only the engine and the thread that follows weights/LATEST change:
a remote engine loads a new version itself (verified staging, pause, reload, resume), so the
watcher hands it the store and the version instead of a state dict.
"""

from __future__ import annotations

import logging
import shlex
import threading
from typing import Any

from areal_core.rollout.sglang_engine import SGLangEngine
from areal_core.rollout.vllm_engine import VLLMEngine
from areal_core.rollout.vllm_server import VLLMServerSpec
from areal_core.store import Store
from areal_core.train.weights import WeightsError

log = logging.getLogger("areal.rollout")

REMOTE_ENGINES = ("vllm", "sglang")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of an HF checkpoint folder/URI (a remote engine needs no local model)."""
    from transformers import AutoTokenizer

    from areal_core.logs import quiet_libraries
    from areal_core.models import localize

    quiet_libraries()
    return AutoTokenizer.from_pretrained(localize(path))


def server_spec(cfg: Any, index: int = 0) -> VLLMServerSpec:
    """The vLLM server of rollout worker `index` from the run config."""
    srv = cfg.rollout.server
    return VLLMServerSpec(
        python=srv.python,
        kv_cache_mb=srv.kv_cache_mb,
        max_model_len=cfg.model.max_position_embeddings,
        max_num_seqs=srv.max_num_seqs,
        dtype=srv.dtype,
        seed=cfg.seed * 7919 + index,
        threads=srv.threads,
        startup_timeout_s=srv.startup_timeout_s,
        extra_args=shlex.split(srv.extra_args),
    )


def build_remote_engine(cfg: Any, store: Store, version: int, eos_id: int | None, index: int = 0):
    """A VLLMEngine (started here, or at rollout.server.url) or an SGLangEngine (at rollout.server.url)."""
    srv = cfg.rollout.server
    if cfg.rollout.engine == "vllm":
        if srv.url:
            return VLLMEngine(srv.url, version, eos_id, interrupt=srv.interrupt, store=store)
        return VLLMEngine.launch(store, version, eos_id, server_spec(cfg, index), interrupt=srv.interrupt)
    if cfg.rollout.engine == "sglang":
        return SGLangEngine(srv.url, version, eos_id, store=store)
    raise ValueError(f"not a remote engine: {cfg.rollout.engine!r}")


class RemoteWeightWatcher(threading.Thread):
    """Polls weights/LATEST and has the remote engine load each newer version mid-flight.

    Same surface as the worker's WeightWatcher (`stop`, `new_version`, `latest_staged`). A
    version that fails its checks is skipped with a warning and retried at the next poll; any
    other failure (the server died) is kept in `error` and stops the thread, and the worker
    raises it.
    """

    def __init__(self, store: Store, engine: Any, interval_s: float):
        super().__init__(daemon=True)
        self.store, self.engine, self.interval_s = store, engine, interval_s
        self.latest_staged = engine.version
        self.stop = threading.Event()
        self.new_version = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            latest = self.store.latest_version()
            if latest is not None and latest > self.latest_staged:
                try:
                    self.engine.update_from_store(self.store, latest)
                    self.latest_staged = latest
                    self.new_version.set()
                except WeightsError as exc:
                    log.warning("%s", exc)
                except Exception as exc:  # noqa: BLE001 - handed to the worker thread
                    self.error = exc
                    self.new_version.set()
                    return
            self.stop.wait(self.interval_s)
