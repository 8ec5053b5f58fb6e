"""The weight side of the in-process engines (torch, continuous): a version arrives from any
thread and is installed between two decode steps.

`receive(store, v)` (the weight watcher's thread) reads and verifies weights/v{v}
(`weights.reader.load_state_dict`) and stages the state dict in a one-slot mailbox that keeps
only the newest version; the engine's own thread installs it at the next step boundary
(`_install_staged`), and the generation loop then re-prefills under the new weights. With
`swap_mid_generation` off a version is installed only when no row is mid-generation (at the
start of the next `generate` call, or while idle): tokens up to one version older, no re-prefill.

A swap mid-generation drops the KV cache and re-prefills every row in flight, prompt and answer so
far: at 8 rows of 4k tokens that is a 32k-token forward per version. AReaL's interruptible
generation pays it in full (its server flushes the cache on a weight update and the partial
requests are resubmitted). `reprefill_budget` (rollout.reprefill_budget_tokens) bounds it: while
more tokens than that are in flight, a staged version waits and decoding goes on under the current
one, exactly (its tokens carry the version that produced them; the staleness rules see them as
such); it is installed at the first step with few enough tokens in flight, or between calls.
`deferred_swap_steps` counts the steps it waited.
"""

from __future__ import annotations

import threading

import torch

from areal_core.store import Store
from areal_core.weights import WeightsError
from areal_core.weights.reader import is_adapter, load_state_dict, read_manifest


def check_fits(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], complete: bool, version: int) -> None:
    """WeightsError unless every tensor of `state_dict` is one of the model's, of its shape, and (when
    `complete`: a whole checkpoint, not a LoRA version's adapted weights) every model tensor is given,
    a tied alias of a given one aside. Checked before staging: `load_state_dict` copies the tensors
    that fit before it raises on one that does not, which would leave the served weights mixed."""
    own = model.state_dict()
    unknown = sorted(k for k in state_dict if k not in own)
    wrong = sorted(k for k in state_dict if k in own and tuple(own[k].shape) != tuple(state_dict[k].shape))
    given = {own[k].data_ptr() for k in state_dict if k in own}
    missing = sorted(k for k, t in own.items() if k not in state_dict and t.data_ptr() not in given) if complete else []
    for what, names in (("names tensors the model has not", unknown), ("has tensors of another shape", wrong)):
        if names:
            raise WeightsError(f"weights v{version} {what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    if missing:
        raise WeightsError(f"weights v{version} lacks {len(missing)} of the model's tensors: {', '.join(missing[:3])}")


class LocalEngine:
    """Base of the in-process engines: `model`, `version`, `swaps`, and the staged-weights mailbox."""

    def __init__(
        self, model: torch.nn.Module, version: int, swap_mid_generation: bool = True, reprefill_budget: int = 0
    ):
        self.model = model.eval()
        self.version = version
        self.swap_mid_generation = swap_mid_generation
        self.reprefill_budget = reprefill_budget
        self.swaps = 0
        self.deferred_swap_steps = 0
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._staged_lock = threading.Lock()

    def receive(self, store: Store, version: int) -> None:
        """RolloutEngine: read, verify and stage weights/v{version}; installed at the next step.
        Raises WeightsError (nothing staged) when the version fails its checks."""
        if version > self.version:
            state_dict = load_state_dict(store, version)
            check_fits(self.model, state_dict, complete=not is_adapter(read_manifest(store, version)), version=version)
            self.stage_weights(version, state_dict)

    def stage_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Called from any thread; keeps only the newest staged version."""
        with self._staged_lock:
            if self._staged is None or version > self._staged[0]:
                self._staged = (version, state_dict)

    def _swap_now(self, in_flight_tokens: int) -> bool:
        """Whether a staged version may be installed at this step, with `in_flight_tokens` (prompt
        and answer so far of the rows mid-generation) to re-prefill if it is (module docstring)."""
        if in_flight_tokens == 0:
            return True
        if not self.swap_mid_generation:
            return False
        if self.reprefill_budget > 0 and in_flight_tokens > self.reprefill_budget and self._staged is not None:
            self.deferred_swap_steps += 1
            return False
        return True

    def _install_staged(self) -> bool:
        """Install the staged version if it is newer than the current one; True if weights changed."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is None or staged[0] <= self.version:
            return False
        version, sd = staged
        self.model.load_state_dict(sd, strict=False)
        self._after_install()
        self.version = version
        self.swaps += 1
        return True

    def _after_install(self) -> None:
        """Hook: refresh what depends on the weights (the continuous engine's packed decoder)."""

    def load_version(self, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Install `state_dict` as `version` now, or (without one) whatever version is staged."""
        if state_dict is not None:
            self.stage_weights(version, state_dict)
        self._install_staged()

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""
