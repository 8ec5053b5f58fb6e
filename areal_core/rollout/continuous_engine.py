"""Continuous-batching engine for cpu / cuda / npu over a pre-allocated KV cache.

A fixed number of slots (rows of the static cache, `static_cache.StaticCacheDecoder`) hold
the sequences being generated. Every engine step runs one decode pass over the active rows
0..n−1 and a batched prefill of the requests admitted into free slots, then samples one token
per row (`sampling.sample`). A finished sequence frees its slot at once: the last active row
is moved into it (compaction keeps the active rows contiguous) and the next waiting request is
prefilled into the free rows in the same step, so a long request never holds back short ones.

Weight swaps happen between steps: `receive` / `stage_weights` (any thread, `local_engine.py`)
stages a version; at the next step boundary the engine installs it, drops the KV cache of every
active row and re-prefills prompt + generated tokens under the new weights, then continues
(`swap_mid_generation=False`: only at a step with no active row, i.e. the next call's first).
The version is read once per step, after the install, so token t of a request carries exactly the version whose weights
produced the logits it was sampled from.

Randomness is counter-based per request (seed, token index), so a seeded request gives the
same tokens whatever slot or batch it runs in, and across a swap to equal weights.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from areal_core.rollout.engine import Generation, SamplingParams
from areal_core.rollout.local_engine import LocalEngine
from areal_core.rollout.mla_decoder import MlaCacheDecoder
from areal_core.rollout.route_recorder import RequestRoutes
from areal_core.rollout.sampling import RowParams, sample
from areal_core.rollout.static_cache import StaticCacheDecoder, build_decoder, check_supported
from areal_core.routes import route_shape

log = logging.getLogger("areal.rollout.continuous")


class EngineError(RuntimeError):
    """Generation failed inside the engine; the message says where (step, version, rows)."""


@dataclass
class _Batch:
    """Host-side state of one `generate` call: per-request arrays and per-row (slot) arrays."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    seeds: np.ndarray
    max_new: np.ndarray
    out_tok: np.ndarray  # [R, max_new_max]
    out_lp: np.ndarray
    gen: np.ndarray  # tokens generated per request
    start_step: np.ndarray  # engine step that sampled the request's first token
    reason: list[str]
    stop_ids: list[frozenset[int]]
    uniform_stops: np.ndarray | None  # the shared stop ids when every request has the same set
    row_req: np.ndarray  # [slots] request in each row
    seq_len: np.ndarray  # [slots] tokens held in the row's cache
    next_tok: np.ndarray  # [slots] last sampled token, not yet in the cache


class ContinuousEngine(LocalEngine):
    """Same interface as `TorchEngine`: generate, receive, stage_weights, load_version, version, health.

    slots: rows decoded together; max_seq_len: cache length per row (None: sized on first use
    to the call's longest prompt + max_new_tokens, grown only when a later call needs more);
    prefill_tokens: token budget of one prefill chunk; tokenizer: needed for stop strings;
    policy: "continuous" (refill freed slots every step) or "static" (admit only when all
    slots are empty: static batching with the same kernels, for comparison).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        eos_id: int,
        version: int = 0,
        seed: int = 0,
        slots: int = 64,
        max_seq_len: int | None = None,
        prefill_tokens: int = 8192,
        tokenizer=None,
        policy: str = "continuous",
        swap_mid_generation: bool = True,
        step_delay_s: float = 0.0,
        reprefill_budget: int = 0,
    ):
        check_supported(model)
        if policy not in {"continuous", "static"}:
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        super().__init__(model, version, swap_mid_generation, reprefill_budget)
        self.pad_id, self.eos_id = pad_id, eos_id
        self.device = next(model.parameters()).device
        self.slots, self.max_seq_len, self.prefill_tokens = slots, max_seq_len, prefill_tokens
        self.tokenizer, self.policy = tokenizer, policy
        self.step_delay_s = step_delay_s  # benchmarks: a slower engine at the same sampling
        self.generator = torch.Generator().manual_seed(seed)  # draws request seeds
        self.runner: StaticCacheDecoder | MlaCacheDecoder | None = None
        # prefill_shared: rows whose prefill was copied from an identical sequence's row
        keys = ("steps", "decode_steps", "prefill_chunks", "tokens", "reprefill_tokens", "prefill_shared")
        self.stats = dict.fromkeys(keys, 0)
        self.last_error: str | None = None
        self._route_shape = route_shape(model)  # an MoE records each pass's experts (route_recorder.RequestRoutes)
        self._routes: RequestRoutes | None = None

    # -- weights ------------------------------------------------------------------------------
    def _after_install(self) -> None:
        if self.runner is not None:
            self.runner.refresh()

    def health(self) -> dict:
        return {
            "ok": self.last_error is None,
            "version": self.version,
            "swaps": self.swaps,
            "deferred_swap_steps": self.deferred_swap_steps,
            "slots": self.slots,
            **self.stats,
            **({"error": self.last_error} if self.last_error else {}),
        }

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Generation]:
        """One Generation per prompt. `params` is shared, or one per prompt. With a shared
        `params.seed` s request i is seeded s + i; a list uses each one's seed; without a seed,
        seeds are drawn from the engine's generator (seeded at construction)."""
        if not prompts:
            return []
        batch = self._new_batch(prompts, params)
        self._ensure_runner(max(len(p) for p in prompts) + int(batch.max_new.max()))
        step = 0
        active = 0
        pending: deque[int] = deque(range(len(prompts)))
        try:
            while pending or active:
                active = self._step(batch, pending, active, step)
                step += 1
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise EngineError(
                f"continuous engine failed at step {step} of a {len(prompts)}-request call "
                f"(version {self.version}, {active} active rows, {len(pending)} waiting): {self.last_error}"
            ) from exc
        versions, record = self._step_versions, self._routes
        out = []
        for r in range(len(prompts)):
            n, s0 = int(batch.gen[r]), int(batch.start_step[r])
            routes = None if record is None else record.routes(r, len(prompts[r]) + n)
            toks, lps = batch.out_tok[r, :n].tolist(), batch.out_lp[r, :n].tolist()
            out.append(Generation(toks, lps, versions[s0 : s0 + n], batch.reason[r], routes=routes))
        self._routes = None
        return out

    def _new_batch(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> _Batch:
        R = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * R
        if len(plist) != R:
            raise ValueError(f"{len(plist)} sampling params for {R} prompts")
        if any(p.stop for p in plist) and self.tokenizer is None:
            raise ValueError("stop strings need an engine built with a tokenizer")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        shared = not isinstance(params, (list, tuple))
        seeds = np.empty(R, dtype=np.int64)
        for i, p in enumerate(plist):
            if p.seed is not None:
                seeds[i] = p.seed + i if shared else p.seed
            else:
                seeds[i] = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        max_new = np.array([p.max_new_tokens for p in plist], dtype=np.int64)
        stop_ids = [frozenset({self.eos_id, *p.stop_token_ids}) for p in plist]
        uniform = np.array(sorted(stop_ids[0]), dtype=np.int64) if len(set(stop_ids)) == 1 else None
        self._step_versions: list[int] = []
        if self._route_shape is not None:
            self._routes = RequestRoutes(self._route_shape, [len(p) + int(n) for p, n in zip(prompts, max_new)])
        return _Batch(
            prompts=[list(p) for p in prompts],
            params=plist,
            seeds=seeds,
            max_new=max_new,
            out_tok=np.zeros((R, max(1, int(max_new.max()))), dtype=np.int64),
            out_lp=np.zeros((R, max(1, int(max_new.max()))), dtype=np.float32),
            gen=np.zeros(R, dtype=np.int64),
            start_step=np.zeros(R, dtype=np.int64),
            reason=["length"] * R,
            stop_ids=stop_ids,
            uniform_stops=uniform,
            row_req=np.zeros(self.slots, dtype=np.int64),
            seq_len=np.zeros(self.slots, dtype=np.int64),
            next_tok=np.zeros(self.slots, dtype=np.int64),
        )

    def _ensure_runner(self, need: int) -> None:
        if self.runner is not None and (self.max_seq_len is not None or self.runner.max_len >= need):
            return
        max_len = self.max_seq_len or -(-need // 64) * 64
        self.runner = build_decoder(self.model, self.slots, max_len)
        self.runner.on_route = self._on_route

    def _on_route(self, layer: int, ids: torch.Tensor) -> None:
        if self._routes is not None:
            self._routes.collect(layer, ids)

    def _step(self, b: _Batch, pending: deque[int], n: int, step: int) -> int:
        """One engine step; returns the number of active rows after it."""
        runner = self.runner
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        swapped = self._install_staged() if self._swap_now(int(b.seq_len[:n].sum())) else False
        parts: list[torch.Tensor] = []
        if n and swapped:  # drop the cache: re-prefill prompt + generated tokens under the new weights
            seqs = [b.prompts[r] + b.out_tok[r, : b.gen[r]].tolist() for r in b.row_req[:n]]
            self.stats["reprefill_tokens"] += sum(len(s) for s in seqs)
            parts.append(self._prefill(list(range(n)), seqs, b))
        elif n:
            pos = torch.from_numpy(b.seq_len[:n]).to(self.device)
            ids = torch.from_numpy(b.next_tok[:n]).to(self.device)
            parts.append(runner.decode(ids, pos, int(b.seq_len[:n].max()) + 1))
            if self._routes is not None:
                self._routes.decode(b.row_req[:n].tolist(), b.seq_len[:n].tolist())
            b.seq_len[:n] += 1
            self.stats["decode_steps"] += 1
        free = self.slots - n if (self.policy == "continuous" or n == 0) else 0
        k = min(free, len(pending))
        if k:
            new = [pending.popleft() for _ in range(k)]
            b.row_req[n : n + k] = new
            b.start_step[new] = step
            parts.append(self._prefill(list(range(n, n + k)), [b.prompts[r] for r in new], b))
            n += k
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        req = b.row_req[:n].copy()
        g = b.gen[req]
        tok, lp = sample(logits, self._row_params(b, req), torch.from_numpy(g).to(self.device))
        self._step_versions.append(self.version)
        host = torch.stack([tok.to(torch.float64), lp.to(torch.float64)]).cpu().numpy()
        tok_np, lp_np = host[0].astype(np.int64), host[1].astype(np.float32)
        b.out_tok[req, g] = tok_np
        b.out_lp[req, g] = lp_np
        b.gen[req] = g + 1
        b.next_tok[:n] = tok_np
        self.stats["steps"] += 1
        self.stats["tokens"] += n
        if b.uniform_stops is not None:
            stopped = np.isin(tok_np, b.uniform_stops)
        else:
            stopped = np.array([int(t) in b.stop_ids[r] for t, r in zip(tok_np, req)])
        for i in np.flatnonzero(~stopped):
            if b.params[req[i]].stop and self._hit_stop_string(b, int(req[i])):
                stopped[i] = True
        full = (g + 1 >= b.max_new[req]) | (b.seq_len[:n] >= runner.max_len)
        done = stopped | full
        if not done.any():
            return n
        for i in np.flatnonzero(done):
            b.reason[req[i]] = "stop" if stopped[i] else "length"
        return self._compact(b, n, np.flatnonzero(done).tolist())

    def _hit_stop_string(self, b: _Batch, r: int) -> bool:
        stops = b.params[r].stop
        window = max(len(s) for s in stops) + 2
        n = int(b.gen[r])
        text = self.tokenizer.decode(b.out_tok[r, max(0, n - window) : n].tolist())
        return any(s in text for s in stops)

    def _compact(self, b: _Batch, n: int, finished: list[int]) -> int:
        """Free the finished rows: move the surviving rows beyond the new end into the holes."""
        n_new = n - len(finished)
        gone = set(finished)
        holes = [r for r in finished if r < n_new]
        movers = [r for r in range(n_new, n) if r not in gone]
        if movers:
            self.runner.move_rows(movers, holes, int(b.seq_len[movers].max()))
            for arr in (b.row_req, b.seq_len, b.next_tok):
                arr[holes] = arr[movers]
        return n_new

    def _row_params(self, b: _Batch, req: np.ndarray) -> RowParams:
        key = req.tobytes()
        cached = getattr(self, "_rp_for", None)
        # the batch object itself, not id(b): a finished batch's id is reused by the next one
        if cached is not None and cached[0] is b and cached[1] == key:
            return self._rp
        ps = [b.params[r] for r in req]
        greedy = np.array([p.is_greedy for p in ps])
        vocab = self.runner.lm_head.shape[0]
        dev = self.device
        rp = RowParams(
            temperature=torch.tensor([1.0 if gr else p.temperature for p, gr in zip(ps, greedy)], device=dev),
            top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in ps], device=dev),
            top_p=torch.tensor([p.top_p for p in ps], device=dev),
            greedy=torch.from_numpy(greedy).to(dev),
            seeds=torch.from_numpy(b.seeds[req]).to(dev),
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_filter=any((0 < p.top_k < vocab) or p.top_p < 1.0 for p, gr in zip(ps, greedy) if not gr),
        )
        self._rp_for, self._rp = (b, key), rp
        return rp

    def _prefill(self, rows: list[int], seqs: list[list[int]], b: _Batch) -> torch.Tensor:
        """Prefill `seqs` into cache rows `rows` and return their last-position logits [len(rows), V].
        Identical sequences (a group's samples share their prompt) are computed once, into the
        first one's row, and that row's cache is copied to the others."""
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        uniq = sorted(first.values())
        logits = self._prefill_rows([rows[i] for i in uniq], [seqs[i] for i in uniq], b)
        if len(uniq) == len(seqs):
            return logits
        dup = [i for i, j in enumerate(src) if j != i]
        self.runner.move_rows([rows[src[i]] for i in dup], [rows[i] for i in dup], max(len(seqs[i]) for i in dup))
        b.seq_len[[rows[i] for i in dup]] = [len(seqs[i]) for i in dup]
        for i in dup if self._routes is not None else ():
            self._routes.copy(int(b.row_req[rows[src[i]]]), int(b.row_req[rows[i]]), len(seqs[i]))
        self.stats["prefill_shared"] += len(dup)
        at = {i: k for k, i in enumerate(uniq)}
        return logits[torch.tensor([at[j] for j in src], device=logits.device)]

    def _prefill_rows(self, rows: list[int], seqs: list[list[int]], b: _Batch) -> torch.Tensor:
        """Batched prefill of `seqs` into cache rows `rows`, in chunks of ≤ prefill_tokens padded
        tokens; sets the rows' cache lengths and returns the last-position logits [len(rows), V]."""
        out = []
        i = 0
        while i < len(rows):
            j, longest = i, 0
            while j < len(rows) and (j == i or max(longest, len(seqs[j])) * (j - i + 1) <= self.prefill_tokens):
                longest = max(longest, len(seqs[j]))
                j += 1
            chunk = seqs[i:j]
            if longest > self.runner.max_len:
                raise ValueError(f"sequence of {longest} tokens exceeds the cache length {self.runner.max_len}")
            ids = torch.full((j - i, longest), self.pad_id, dtype=torch.long)
            for k, s in enumerate(chunk):
                ids[k, : len(s)] = torch.tensor(s, dtype=torch.long)
            lens = torch.tensor([len(s) for s in chunk])
            dev = self.device
            out.append(self.runner.prefill(torch.tensor(rows[i:j], device=dev), ids.to(dev), lens.to(dev)))
            if self._routes is not None:
                self._routes.prefill(b.row_req[rows[i:j]].tolist(), lens.tolist(), longest)
            b.seq_len[rows[i:j]] = lens.numpy()
            self.stats["prefill_chunks"] += 1
            i = j
        return out[0] if len(out) == 1 else torch.cat(out)
