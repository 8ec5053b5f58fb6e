"""The weight side of the in-process engines (torch, continuous): a version arrives from any
thread and is installed between two decode steps.

`receive(store, v)` (the weight watcher's thread) reads and verifies weights/v{v}
(`weights.reader.load_state_dict`) and stages the state dict in a one-slot mailbox that keeps
only the newest version; the engine's own thread installs it at the next step boundary
(`_install_staged`), and the generation loop then re-prefills under the new weights. With
`swap_mid_generation` off a version is installed only when no row is mid-generation (at the
start of the next `generate` call, or while idle): tokens up to one version older, no re-prefill.
"""

from __future__ import annotations

import threading

import torch

from areal_core.store import Store
from areal_core.weights.reader import load_state_dict


class LocalEngine:
    """Base of the in-process engines: `model`, `version`, `swaps`, and the staged-weights mailbox."""

    def __init__(self, model: torch.nn.Module, version: int, swap_mid_generation: bool = True):
        self.model = model.eval()
        self.version = version
        self.swap_mid_generation = swap_mid_generation
        self.swaps = 0
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._staged_lock = threading.Lock()

    def receive(self, store: Store, version: int) -> None:
        """RolloutEngine: read, verify and stage weights/v{version}; installed at the next step.
        Raises WeightsError (nothing staged) when the version fails its checks."""
        if version > self.version:
            self.stage_weights(version, load_state_dict(store, version))

    def stage_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Called from any thread; keeps only the newest staged version."""
        with self._staged_lock:
            if self._staged is None or version > self._staged[0]:
                self._staged = (version, state_dict)

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
