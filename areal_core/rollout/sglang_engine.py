"""SGLang rollout engine: a client of SGLang's native HTTP API at a given URL.

UNVERIFIED against a live SGLang server: SGLang has no CPU kernels, so it cannot run on
the machines this project is developed and tested on. The client is written to SGLang's
documented request and response shapes (python/sglang/srt/entrypoints/http_server.py and
managers/io_struct.py) and tested against a stand-in server that implements exactly those
shapes (tests/test_sglang_engine.py). See docs/vllm.md, "SGLang".

Calls used:

- `POST /generate` `{"input_ids": [...], "sampling_params": {...}, "return_logprob": true,
  "logprob_start_len": -1, "top_logprobs_num": 0}` →
  `{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [[logprob, token_id, text|null], ...], "weight_version": "N", ...}}`
- `POST /pause_generation` `{"mode": "abort"}` → in-flight requests return now with
  `finish_reason.type == "abort"` and their tokens so far; new requests wait.
- `POST /update_weights_from_disk` `{"model_path": dir, "weight_version": "N", "flush_cache": true}`
  → `{"success": bool, "message": str, "num_paused_requests": int}` (400 on failure).
- `POST /flush_cache` → 200, or 400 while requests still hold cache.
- `POST /continue_generation` `{}`; `POST /abort_request` `{"abort_all": true}`;
  `GET /health`; `GET /get_weight_version` → `{"weight_version": "N"}`.

Versions per segment: SGLang reports one `weight_version` per response, not per token, so the
engine updates weights on the abort path only. A pause aborts every in-flight request; the
engine re-submits each as prompt + tokens so far; the continuation waits for
`/continue_generation` and runs under the new weights. No segment spans an update: an aborted
segment's tokens carry the version the engine held when it was submitted (it was in flight
before the pause), a finished segment's tokens the `weight_version` of its own response.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.remote_engine import RemoteEngine, RemoteEngineError


class SGLangEngineError(RemoteEngineError):
    """A request or control call to the SGLang server failed; the message names the call."""


class SGLangEngine(RemoteEngine):
    """RolloutEngine over an SGLang server; `generate` and `receive` may overlap.

    Constructor: `SGLangEngine(url, version, eos_id, *, staging_dir, store, request_timeout_s,
    max_concurrency, set_version)` (`RemoteEngine`)."""

    name = "SGLang"
    engine = "sglang"
    error_cls = SGLangEngineError
    generate_path = "/generate"
    health_timeout_s = 30.0
    interrupt = "abort"  # one weight_version per response: updates go through the abort path

    # -- control calls ------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        self._call("POST", "/pause_generation", json={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def _abort_server(self) -> None:
        self._call("POST", "/abort_request", json={"abort_all": True})

    def flush_cache(self, attempts: int = 20, wait_s: float = 0.1) -> None:
        """Flush the radix cache; SGLang answers 400 while requests still hold cache, so retry a little."""
        for _ in range(attempts):
            if self._call("POST", "/flush_cache", ok=(200, 400)).status_code == 200:
                return
            time.sleep(wait_s)
        raise SGLangEngineError(f"SGLang /flush_cache at {self.url} kept answering 400")

    def server_version(self) -> str:
        return str(self._call("GET", "/get_weight_version").json()["weight_version"])

    # -- weights ------------------------------------------------------------------------
    def _reload(self, path: Path, version: int) -> None:
        r = self._call(
            "POST",
            "/update_weights_from_disk",
            ok=(200, 400),
            json={"model_path": str(path), "weight_version": str(version), "flush_cache": True},
        )
        body = r.json()
        if r.status_code != 200 or not body.get("success", False):
            raise SGLangEngineError(f"SGLang update_weights_from_disk v{version} failed: {body.get('message')}")
        self.flush_cache()

    # -- generation ---------------------------------------------------------------------
    def _request_body(self, ids: list[int], params: SamplingParams, max_new: int, segment: int) -> dict:
        sp = self._sampling(params)
        sp["max_new_tokens"] = max_new
        return {
            "input_ids": ids,
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": -1,  # output tokens only
            "top_logprobs_num": 0,
            "stream": False,
        }

    @staticmethod
    def _segment_version(meta: dict, fallback: int) -> int:
        v = meta.get("weight_version")
        try:
            return int(v) if v is not None else fallback
        except (TypeError, ValueError):
            raise SGLangEngineError(f"weight_version {v!r} is not a policy version") from None

    def _parse_response(self, data: Any, v_submit: int) -> tuple[list[int], list[float], list[int], str]:
        out = data[0] if isinstance(data, list) else data
        meta = out.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        new = [int(p[1]) for p in pairs]
        if "output_ids" in out and out["output_ids"] != new:
            raise SGLangEngineError("output_ids and output_token_logprobs disagree")
        finish = ((meta.get("finish_reason") or {}).get("type")) or "length"
        # An aborted segment was in flight when a pause came, so it ran under the weights
        # of its submission; a finished one ran under one version, the one it reports.
        seg_version = v_submit if finish == "abort" else self._segment_version(meta, v_submit)
        return new, [float(p[0]) for p in pairs], [seg_version] * len(new), finish
