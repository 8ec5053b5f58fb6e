"""The host side of the call boundary: the program's functions as remote functions (stdlib only).

Runs in the trusted test process (`harness.py`). For each test, `Session.begin` asks the
sandbox for the names the test needs but does not define itself; each one the program defines
becomes, in the test's namespace:

* a function: `remote_function(name)`, a plain host function whose every call crosses the
  boundary (arguments in, the return value and any arguments the program changed in place
  back, all in the typed encoding of `codec`);
* plain data: its value, decoded here;
* a module of the standard library on `MIRRORED`: the host's own copy of it.

Builtins, `math`, loops, helpers and comparisons therefore all run here, where the program
cannot reach them. A call that cannot complete (timeout, the program died, a value that cannot
cross, a malformed reply) fails the test whatever the test does with the error afterwards:
the session keeps the first such failure and the verdict reads it. An exception the program
raised comes back by name (`RemoteError`, also a subclass of the built-in exception of that
name for the ordinary ones: `except ValueError` in a test still works).
"""

from __future__ import annotations

import builtins
import errno
import importlib
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any

codec = sys.modules.get("_areal_codec")
if codec is None:  # imported as part of the package (tests), not loaded by the harness
    from areal_core.reward import codec

MIRRORED = frozenset(
    "array bisect calendar cmath collections copy datetime decimal fractions functools hashlib heapq itertools "
    "json math numbers operator random re statistics string textwrap typing unicodedata".split()
)
_MAPPED = (
    "ArithmeticError AttributeError FloatingPointError IndexError KeyError LookupError NameError "
    "NotImplementedError OverflowError RecursionError RuntimeError TypeError ValueError ZeroDivisionError".split()
)
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


class BoundaryFailure(BaseException):
    """A call could not complete; the test fails with `Session.failure` whatever it catches."""


class RemoteError(Exception):
    """An exception raised by the program: `remote_name` is its type's name, the message its text."""

    remote_name = "Exception"


_classes = {name: type(name, (RemoteError, getattr(builtins, name)), {}) for name in _MAPPED}


def remote_exception(name: str, message: Any) -> RemoteError:
    exc = _classes.get(name, RemoteError)(str(message)[:300])
    exc.remote_name = name[:60]
    return exc


class Lost(Exception):
    """The channel is unusable: `kind` is "ended" (EOF), "timeout" or "protocol"."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


class Channel:
    """Length-prefixed messages over two pipes, every read and write under a deadline."""

    def __init__(self, wfd: int, rfd: int, max_bytes: int):
        self.w, self.r, self.max_bytes = wfd, rfd, max_bytes
        os.set_blocking(wfd, False)
        os.set_blocking(rfd, False)

    def send(self, tree: Any, deadline: float) -> None:
        data = codec.dumps(tree)
        data = len(data).to_bytes(4, "big") + data
        while data:
            self._ready(self.w, "w", deadline)
            try:
                data = data[os.write(self.w, data) :]
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    raise Lost("ended", "the program ended") from None
                raise

    def recv(self, deadline: float) -> Any:
        size = int.from_bytes(self._read(4, deadline), "big")
        if size > self.max_bytes:
            raise Lost("protocol", f"output over limit: a reply of more than {self.max_bytes} bytes")
        try:
            return codec.loads(self._read(size, deadline))
        except ValueError as exc:
            raise Lost("protocol", f"malformed reply from the sandbox: {str(exc)[:100]}") from None

    def _read(self, n: int, deadline: float) -> bytes:
        parts, got = [], 0
        while got < n:
            self._ready(self.r, "r", deadline)
            try:
                chunk = os.read(self.r, min(n - got, 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise Lost("ended", "the program ended")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    @staticmethod
    def _ready(fd: int, mode: str, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Lost("timeout", "timeout")
        r, w, _ = select.select([fd] if mode == "r" else [], [fd] if mode == "w" else [], [], left)
        if not (r or w):
            raise Lost("timeout", "timeout")


class Session:
    """One test's conversation with the program's worker in the sandbox."""

    def __init__(self, chan: Channel, call_s: float):
        self.chan, self.call_s = chan, call_s
        self.failure: str | None = None  # the first reason the test cannot pass
        self.lost: str | None = None  # why the channel is unusable, if it is
        self.ended: str | None = None  # the worker's end ("exit N" / "signal N") when it died during the test
        self.loaded = False
        self.last: tuple[str, Any] | None = None  # (name, value) of the last call that returned
        self.calls = 0

    def fail(self, reason: str, lost: str | None = None) -> Any:
        if self.failure is None:
            self.failure = reason
        self.lost = self.lost or lost
        raise BoundaryFailure(reason)

    def _exchange(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        try:
            self.chan.send(message, time.monotonic() + timeout)
            reply = self.chan.recv(time.monotonic() + timeout)
        except Lost as exc:
            if exc.kind == "timeout":
                self.fail(f"timeout: {what} ran over {timeout:g}s (sandbox killed)", "timeout")
            self.fail(str(exc) if exc.kind == "protocol" else f"{exc} during {what}", exc.kind)
        if not isinstance(reply, dict):
            self.fail("malformed reply from the sandbox", "protocol")
        if "ended" in reply:
            self.ended = str(reply["ended"])[:40]
            self.fail(f"the program ended during {what}")
        return reply

    def begin(self, names: set[str], timeout: float) -> dict[str, Any]:
        """Start the test's worker; the manifest of `names` (name -> entry)."""
        reply = self._exchange({"op": "begin", "names": sorted(names)}, timeout, "loading the program")
        manifest = reply.get("manifest")
        if not isinstance(manifest, dict):
            self.fail("malformed manifest from the sandbox", "protocol")
        self.loaded = True
        return manifest

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.failure is not None:
            raise BoundaryFailure(self.failure)
        what = f"{name}(...)"
        try:
            message = {
                "op": "call",
                "name": name,
                "args": [codec.encode(a) for a in args],
                "kwargs": [[k, codec.encode(v)] for k, v in kwargs.items()],
            }
        except codec.Uncrossable as exc:
            self.fail(f"an argument of {what}: {exc}")
        reply = self._exchange(message, self.call_s, what)
        self.calls += 1
        if "raise" in reply:
            kind = str(reply["raise"])
            if kind == "MemoryError":
                self.fail(f"memory limit: MemoryError in {what}")
            raise remote_exception(kind, reply.get("message", ""))
        if "fail" in reply:
            self.fail(str(reply["fail"])[:300])
        try:
            value = codec.decode(reply["value"])
            changed = [(key, codec.decode(tree)) for key, tree in reply.get("changed") or []]
        except (KeyError, TypeError, ValueError) as exc:
            self.fail(f"malformed reply to {what}: {str(exc)[:100]}")
        for key, new in changed:
            target = args[key] if type(key) is int and 0 <= key < len(args) else kwargs.get(key)
            if target is None or not merge(target, new):
                self.fail(f"malformed reply to {what}: argument {str(key)[:20]} changed impossibly")
        self.last = (name, value)
        return value

    def end(self) -> None:
        """Tell the worker the test is over and wait for its end (keeps the channel in step)."""
        if not self.loaded or self.lost or self.ended is not None:
            return
        try:
            self.chan.send({"op": "end"}, time.monotonic() + self.call_s)
            reply = self.chan.recv(time.monotonic() + self.call_s)
            if not isinstance(reply, dict) or "ended" not in reply:
                self.lost = "protocol"
        except Lost as exc:
            self.lost = exc.kind


def remote_function(session: Session, name: str) -> Callable[..., Any]:
    """A host function standing for the program's `name`: calling it calls the program."""

    def remote(*args: Any, **kwargs: Any) -> Any:
        return session.call(name, args, kwargs)

    remote.__name__ = remote.__qualname__ = name
    remote.__doc__ = f"the program's {name}, called in the sandbox"
    return remote


def bind(session: Session, manifest: dict[str, Any], wanted: set[str], ns: dict[str, Any]) -> None:
    """Put the manifest's entries for `wanted` names into the test's namespace `ns`."""
    for name, entry in manifest.items():
        if name not in wanted or type(entry) is not list or not entry:
            continue
        kind = entry[0]
        if kind == "function":
            ns[name] = remote_function(session, name)
        elif kind == "value" and len(entry) == 2:
            try:
                ns[name] = codec.decode(entry[1])
            except ValueError:
                continue
        elif kind == "module" and len(entry) == 2 and entry[1] in MIRRORED:
            ns[name] = importlib.import_module(entry[1])


def merge(target: Any, new: Any) -> bool:
    """Make the host's `target` hold `new` in place (an argument the program changed); False if impossible."""
    kind = type(target)
    if kind is not type(new) or kind in _IMMUTABLE or kind is frozenset:
        return False
    if kind is list:
        for i in range(min(len(target), len(new))):
            if not merge(target[i], new[i]):
                target[i] = new[i]
        if len(new) < len(target):
            del target[len(new) :]
        else:
            target.extend(new[len(target) :])
    elif kind is dict:
        old = dict(target)
        target.clear()
        for k, v in new.items():
            target[k] = old[k] if k in old and merge(old[k], v) else v
    elif kind is set:
        target.clear()
        target.update(new)
    elif kind is tuple:
        if len(target) != len(new):
            return False
        for a, b in zip(target, new):
            merge(a, b)  # only the mutable parts of a tuple can change
    else:
        return False
    return True
