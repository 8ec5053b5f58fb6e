"""`train.compile`: the trainer's decoder compiled by `torch.compile` (inductor) for the training
step only, its backward compiled with it (AOTAutograd).

What is compiled: the policy's decoder (`head.decoder_module`: the embeddings, every layer and the final
norm), the one module both of the step's forward paths call (the full-logits path through the
CausalLM and the chunked-head path through `head.hidden_states`). The LM head, the log-softmax and
the loss stay eager: they are small, and the chunked head's activation checkpointing stays as it is.
The compiled callable is set as the decoder's `_compiled_call_impl` (what `nn.Module.compile`
sets) only while a step runs (`CompiledDecoder.active`), so evaluation, generation, checkpoints and
the published weights see the plain module, and the parameters are the same tensors either way.

Shapes: a step's packed rows change width and count every step, so the decoder is compiled with
`dynamic=True` (one graph for all widths; a grad/no-grad switch or a first small check forward
adds a few). A recompile storm cannot happen: once this model's compiled graphs pass
`MAX_GRAPHS`, the step falls back to eager for the rest of the run, with the reason in the log
(dynamo's own `recompile_limit`, 8 per code object, is the backstop under it).

`auto` (`resolve_compile`): off on CPU and on accelerators. Measured on the default job's shapes
(benchmarks/train_compile.py, docs/benchmarks.md "The compiled trainer step"), a cold compile
costs ~63 CPU-s and a step saves ~0.01-0.015 of ~0.17 CPU-s: repaid after ~4,000-6,500 steps, past
the default job's 800 (SmolLM2's compile passed 375 CPU-s unfinished); accelerators are not measured.
`on` compiles wherever it can: not under FSDP2 ranks (sharded parameters), not for a VLM batch or
replayed MoE routes (hooks on the modules), which keep the eager step and say so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from areal_core.train.head import decoder_module

log = logging.getLogger("areal.trainer")

CHOICES = ("auto", "on", "off")
MAX_GRAPHS = 6  # compiled graphs of one model before the step falls back to eager


def resolve_compile(choice: str, device: str) -> tuple[bool, str]:
    """(compile the step?, why) for a `train.compile` choice on `device` (module docstring)."""
    if choice not in CHOICES:
        raise ValueError(f"train.compile must be one of {CHOICES}, not {choice!r}")
    if choice != "auto":
        return choice == "on", f"train.compile={choice}"
    kind = device.split(":")[0]
    if kind == "cpu":
        return False, "train.compile=auto: eager on CPU (a cold compile costs more than it saves in a default run)"
    return False, f"train.compile=auto: eager on {kind} (the compiled step is not measured there yet)"


def graph_count() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledDecoder:
    """The decoder of `model` compiled for the training step, or the eager step with its reason."""

    def __init__(self, model: Any, enabled: bool, reason: str):
        self.decoder = decoder_module(model) if enabled else None
        self.reason = reason
        self.graphs = 0
        self.compiled = None
        self._eager_said: set[str] = set()  # the per-step eager reasons logged (once each)
        if enabled and self.decoder is None:
            self.reason = f"{reason}, but {type(model).__name__} has no decoder module to compile: eager"
        elif self.decoder is not None:
            self.compiled = torch.compile(self.decoder._call_impl, dynamic=True)

    @classmethod
    def for_run(cls, model: Any, choice: str, device: str, distributed: bool) -> CompiledDecoder:
        """The trainer's choice for this run (`resolve_compile`), eager under FSDP2 ranks; logged."""
        enabled, reason = resolve_compile(choice, device)
        if enabled and distributed:
            enabled, reason = False, f"{reason}, but FSDP2 shards the parameters: eager"
        out = cls(model, enabled, reason)
        log.info("trainer step: %s (%s)", "compiled" if out.on else "eager", out.reason)
        return out

    @property
    def on(self) -> bool:
        return self.compiled is not None

    @contextmanager
    def active(self, eager_reason: str = "") -> Iterator[bool]:
        """The compiled decoder while entered (yields whether it is); `eager_reason`: this step
        must run eager (a VLM batch, replayed routes). Past `MAX_GRAPHS` the step turns eager."""
        if not self.on or eager_reason:
            if self.on and eager_reason not in self._eager_said:
                self._eager_said.add(eager_reason)
                log.info("trainer step: eager for %s (train.compile cannot compile such a step)", eager_reason)
            yield False
            return
        before = graph_count()
        self.decoder._compiled_call_impl = self.compiled
        try:
            yield True
        finally:
            self.decoder._compiled_call_impl = None
            self.graphs += graph_count() - before
            if self.graphs > MAX_GRAPHS:
                self.compiled = None
                self.reason = f"{self.graphs} compiled graphs (> {MAX_GRAPHS}): shapes keep changing, eager from now"
                log.warning("trainer step: eager from now on (%s)", self.reason)


def step_eager_reason(mm: object | None, replayed_routes: bool) -> str:
    """Why this step cannot run compiled ('' when it can): images or replayed routes hook modules."""
    if mm is not None:
        return "an image batch"
    if replayed_routes:
        return "replayed MoE routes"
    return ""


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """Names of `model`'s modules that currently run compiled (none outside a step)."""
    return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
