"""A one-slot mailbox for weights: any thread stages a version, the engine takes it between steps."""

from __future__ import annotations

import threading

import torch


class StagedWeights:
    """Keeps only the newest staged version; `take_newer` empties the slot."""

    def __init__(self) -> None:
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if self._staged is None or version > self._staged[0]:
                self._staged = (version, state_dict)

    def take_newer(self, current: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The staged (version, state_dict) if it is newer than `current`, else None."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None or staged[0] <= current:
            return None
        return staged
