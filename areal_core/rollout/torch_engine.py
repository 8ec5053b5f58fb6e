"""Built-in torch engine: batched generation with a KV cache and interruptible weight swaps.

Between two decode steps the engine installs weights staged by another thread (`receive` /
`stage_weights`, `local_engine.py`). It then drops the KV cache, re-prefills prompt + generated
tokens under the new weights and continues; every token records the version that sampled it.

The behaviour log-prob recorded per token is that of the temperature-scaled distribution
before top-k/top-p filtering, which is what the trainer recomputes.

A vision-language model (docs/vlm.md) takes `generate(prompts, params, mm=[MMInputs | None per
prompt])`: the prefill (and every re-prefill) includes the pixel values and the rows' mrope
positions (areal_core/vlm/inputs.py: VisionPrompts); behaviour log-probs cover only the response.

A mixture of experts records its routing (areal_core/routes.py): every forward's expert choices
(prefill, decode steps, re-prefills) are kept per position (`route_recorder.py`), and each
Generation carries the routes of its prompt and response.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from areal_core.rollout.engine import Generation, SamplingParams
from areal_core.rollout.local_engine import LocalEngine
from areal_core.rollout.route_recorder import RouteBuffer, RouteRecorder
from areal_core.vlm.inputs import VisionPrompts, mask_vision_logits, vision_token_ids
from areal_core.vlm.model import MMInputs


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """(token ids [B], log-probs [B]) from last-position logits [B, V]."""
    logits = logits.float()
    if params.is_greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > params.top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(filtered, dim=-1)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class TorchEngine(LocalEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        eos_id: int,
        version: int = 0,
        seed: int = 0,
        swap_mid_generation: bool = True,
        reprefill_budget: int = 0,
    ):
        super().__init__(model, version, swap_mid_generation, reprefill_budget)
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._banned = vision_token_ids(getattr(model, "config", None))  # a VLM's placeholders; () for a text model
        self._last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._recorder = RouteRecorder(model)  # an MoE's routers; records nothing for a dense model
        self._routes: RouteBuffer | None = None

    def health(self) -> dict:
        return {"ok": True, "version": self.version, "swaps": self.swaps}

    # -- generation ---------------------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, vision: VisionPrompts | None = None
    ) -> torch.Tensor:
        if vision is not None:  # images: pixel values on (re-)prefill, mrope positions
            extra = vision.inputs(self.model, ids, mask, prefill=ids.shape[1] == mask.shape[1])
        else:
            extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]}
        if self._last_logits_only:  # a prefill computes the head on its last position only, not [B, P, vocab]
            extra["logits_to_keep"] = 1
        with self._recorder:
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
            if self._routes is not None:  # this forward's columns: the last ids.shape[1] of the batch so far
                width = ids.shape[1]
                self._routes.write(self._recorder.take(), mask.shape[1] - width, ids.shape[0], width)
        # a VLM never samples its vision placeholders, with or without images (the trainer masks them too)
        return mask_vision_logits(out.logits[:, -1], self._banned)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, mm: Sequence[MMInputs | None] | None = None
    ) -> list[Generation]:
        """`mm`: a vision-language model's images, one MMInputs (or None) per prompt."""
        self._install_staged()
        vision = None if mm is None else VisionPrompts(int(self.model.config.image_token_id), mm)
        bsz = len(prompts)
        plen = max(len(p) for p in prompts)
        seq = torch.full((bsz, plen), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((bsz, plen), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            seq[i, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, plen - len(p) :] = 1
        stops = torch.tensor(sorted({self.eos_id, *params.stop_token_ids}), device=self.device)
        tokens: list[list[int]] = [[] for _ in range(bsz)]
        logprobs: list[list[float]] = [[] for _ in range(bsz)]
        versions: list[list[int]] = [[] for _ in range(bsz)]
        alive = torch.ones(bsz, dtype=torch.bool, device=self.device)
        shape = self._recorder.shape
        self._routes = None if shape is None else RouteBuffer(shape, bsz, plen + params.max_new_tokens)
        cache = DynamicCache()
        logits = self._forward(seq, mask, cache, vision)
        for _ in range(params.max_new_tokens):
            tok, lp = sample_next(logits, params, self.generator)
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
            for i in alive.nonzero().flatten().tolist():
                tokens[i].append(int(tok[i]))
                logprobs[i].append(float(lp[i]))
                versions[i].append(self.version)
            alive &= ~torch.isin(tok, stops)
            if not alive.any():
                break
            seq = torch.cat([seq, tok[:, None]], dim=1)
            mask = torch.cat([mask, alive[:, None].long()], dim=1)
            if self._swap_now(seq.numel()) and self._install_staged():  # the re-prefill runs every row
                cache = DynamicCache()  # re-prefill everything under the new weights
                logits = self._forward(seq, mask, cache, vision)
            else:
                logits = self._forward(seq[:, -1:], mask, cache, vision)
        out = []
        for i in range(bsz):
            stopped = bool(tokens[i]) and tokens[i][-1] in stops.tolist()
            routes = (
                None if self._routes is None else self._routes.row(i, plen - len(prompts[i]), plen + len(tokens[i]))
            )
            out.append(Generation(tokens[i], logprobs[i], versions[i], "stop" if stopped else "length", routes=routes))
        self._routes = None
        return out
