"""Idle cores lent to the trainer's step (`train.borrow_idle_cores`, issue 57).

When the run's roles share one machine (`make run`: trainer, rollout and reward processes on 2 cores), the trainer
is the bottleneck and the rollout waits on admission for part of every step: a core sits idle. Before each decoder
layer's forward and before its backward, the trainer looks at who else wants a CPU right now and sets its torch
thread count:

    others  = R_machine − R_own                    running threads of other processes (R_machine: /proc/loadavg's
                                                   4th field; R_own: this process's threads in state R)
    threads = base + min(extra, max(0, cores − base − others))

with `cores` the CPUs this process may run on, `base` = `threads_per_role` and `extra` = `train.borrow_idle_cores`.
A rollout woken by the new version makes `others` ≥ 1 at the next layer, and the trainer gives the core back.

Replay: the counts a step used are its trace ([1, 2, 2, 1, …], one per layer pass, in order), written in the step's
audit record (`threads`); a replay sets the same count at the same passes (`follow`), so float sums group as they did.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger("areal.trainer")

_LAYER = re.compile(r"(^|\.)(layers|h)\.\d+$")  # model.layers.3 (Llama family), transformer.h.3 (GPT-2)


def running_elsewhere(loadavg: bytes, own_states: list[bytes]) -> int:
    """Running threads of other processes: /proc/loadavg's runnable count ("R/total", 4th field) less this process's
    threads in state R (`own_states`: each thread's state letter)."""
    runnable = int(loadavg.split()[3].split(b"/")[0])
    return max(0, runnable - sum(state == b"R" for state in own_states))


def thread_count(cores: int, base: int, extra: int, others: int) -> int:
    """base + min(extra, max(0, cores − base − others)): the cores nobody else wants, up to `extra` of them."""
    return base + min(extra, max(0, cores - base - others))


def own_thread_states() -> list[bytes]:
    """The state letter (R, S, D, …) of each of this process's threads (/proc/self/task/*/stat)."""
    states = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                states.append(f.read().rsplit(b")", 1)[1].split(None, 1)[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states


def others_running() -> int:
    """How many threads of other processes run or wait to run on this machine now."""
    with open("/proc/loadavg", "rb") as f:
        loadavg = f.read()
    return running_elsewhere(loadavg, own_thread_states())


def usable_cores() -> int:
    """The CPUs this process may run on, fewer under a cgroup v2 CPU quota (/sys/fs/cgroup/cpu.max "QUOTA PERIOD":
    ceil(QUOTA / PERIOD))."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return cores
    return max(1, min(cores, -(-int(quota) // int(period))))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM, LoRA-wrapped or not (…layers.N, …h.N)."""
    return [m for name, m in model.named_modules() if _LAYER.search(name)]


class BorrowedThreads:
    """The trainer's torch thread count, chosen at every decoder layer's forward and backward (`choose`), or followed
    from a recorded trace (`follow`, replay). `step()` brackets one training step: back to `base` threads after it,
    its trace in `trace`."""

    def __init__(self, base: int, extra: int, probe: Callable[[], int] | None = None, cores: int | None = None):
        self.base, self.extra, self._probe = base, extra, probe
        self.cores = cores if cores is not None else usable_cores()
        self.trace: list[int] = []
        self._recorded: list[int] | None = None
        self._recorded_len = 0  # the followed trace's length
        self._active = False

    @classmethod
    def for_run(cls, model: torch.nn.Module, base: int, extra: int, why_not: str | None) -> BorrowedThreads | None:
        """Hooked into `model`'s decoder layers when `extra` > 0 and nothing rules it out (`why_not`: FSDP2, a
        compiled decoder, a non-Linux machine); None otherwise, the reason logged."""
        if extra <= 0:
            return None
        if why_not is None and not os.path.exists("/proc/loadavg"):
            why_not = "no /proc/loadavg on this machine"
        if why_not is None and not decoder_layers(model):
            why_not = "no decoder layers found (…layers.N, …h.N)"
        if why_not is not None:
            log.info("trainer threads: %d (train.borrow_idle_cores=%d not used: %s)", base, extra, why_not)
            return None
        borrowed = cls(base, extra).hooked(model)
        log.info("trainer threads: %d, up to %d more while cores are idle (%d cores)", base, extra, borrowed.cores)
        return borrowed

    def hooked(self, model: torch.nn.Module) -> BorrowedThreads:
        """Itself, its hooks on every decoder layer of `model` (a replay of a run that borrowed hooks a follower,
        `extra` 0, whatever its own config says)."""
        for layer in decoder_layers(model):
            layer.register_forward_pre_hook(self._before_forward)
            layer.register_forward_hook(self._after_forward)
        return self

    def follow(self, trace: list[int] | None) -> None:
        """Replay: the next step uses `trace`'s counts in order (each clamped to 1 … this machine's cores), `base`
        past its end; None: chosen live again."""
        self._recorded = [min(max(int(n), 1), max(self.cores, self.base)) for n in trace] if trace is not None else None
        self._recorded_len = len(self._recorded or [])

    def choose(self) -> None:
        """Set this pass's thread count: the next recorded one, or the idle cores' count now."""
        if not self._active:
            return
        if self._recorded is not None:
            n = self._recorded.pop(0) if self._recorded else self.base
        else:
            others = self._probe() if self._probe is not None else others_running()
            n = thread_count(self.cores, self.base, self.extra, others)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.trace.append(n)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step: its trace starts empty; the thread count is `base` again after it. A followed trace
        that does not match the step's layer passes one for one is logged (the replay's passes differ from the run's:
        another model, micro-batching or checkpointing)."""
        self.trace, self._active = [], True
        try:
            yield
            if self._recorded is not None and len(self.trace) != self._recorded_len:
                log.warning(
                    "replay: the step made %d layer passes where its record names %d thread counts (another model, "
                    "micro-batching or checkpointing?): passes past the record ran on %d threads",
                    len(self.trace),
                    self._recorded_len,
                    self.base,
                )
        finally:
            self._active, self._recorded = False, None
            if torch.get_num_threads() != self.base:
                torch.set_num_threads(self.base)

    def borrowed_share(self) -> float:
        """The share of the step's layer passes that ran on more than `base` threads."""
        return sum(n > self.base for n in self.trace) / len(self.trace) if self.trace else 0.0

    def _before_forward(self, module: torch.nn.Module, args: tuple) -> None:
        self.choose()

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        """The layer's backward begins when its output's gradient arrives: choose then."""
        out = output[0] if isinstance(output, tuple) else output
        if self._active and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.choose()
