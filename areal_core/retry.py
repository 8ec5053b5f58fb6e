"""Transient store errors are retried with backoff for a window, and counted.

A store operation that fails with a transient error (connection refused or reset, a timeout,
an HTTP 5xx or throttling answer) is tried again, with exponential backoff, until it succeeds
or `window_s` has passed since its first failure; then it raises StoreUnavailable naming the
URI and the window. Permanent errors (missing object, permission denied, a 4xx answer, a fenced
root) are raised at once. Every retry is counted in `RetryPolicy.retries`, which the store's
heartbeats carry (`store_retries`).

The window of this process is `POLICY.window_s`: $AREAL_STORE_RETRY_S when set, else 60 s; a
role sets it from the run's config (`store_retry_s`) with `configure`, which also exports it
to the processes it starts.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("areal.store")

RETRY_ENV = "AREAL_STORE_RETRY_S"
DEFAULT_WINDOW_S = 60.0

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    errno.EAGAIN,
}
# Error codes of S3-compatible services that mean "try again later" (any HTTP status >= 500 too).
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
}
# Transport errors by class name (module-qualified names checked against the exception's MRO),
# so this module needs neither botocore nor aiohttp installed.
_TRANSIENT_CLASSES = {
    "botocore.exceptions.HTTPClientError",  # EndpointConnectionError, ConnectionClosedError, timeouts
    "botocore.exceptions.ResponseParserError",  # a throttling answer with invalid XML
    "aiohttp.client_exceptions.ClientConnectionError",  # ClientConnectorError, ServerDisconnectedError
    "aiohttp.client_exceptions.ClientPayloadError",
    "fsspec.exceptions.FSTimeoutError",
    "urllib3.exceptions.ProtocolError",
}
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


class StoreUnavailable(RuntimeError):
    """The store kept failing with transient errors for the whole retry window."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _one_transient(exc: BaseException) -> bool:
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if names & _TRANSIENT_CLASSES:
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):  # refused, reset, aborted, broken pipe
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or code in _TRANSIENT_CODES
    return False


def is_transient(exc: BaseException) -> bool:
    """True when `exc`, or an error it was raised from, is a transport failure or a 5xx/throttling
    answer; False for permanent errors (missing, exists, permission, 4xx) and StoreUnavailable."""
    if isinstance(exc, (*_PERMANENT, StoreUnavailable)) or type(exc).__name__ == "RootLost":
        return False
    return any(_one_transient(e) for e in _chain(exc))


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """The pause before retry number `attempt` (0-based): d = min(cap, base · 2^attempt) · u,
    u ~ Uniform(0.5, 1) (jitter, so that many clients do not retry in lockstep)."""
    u = (rng or random).uniform(0.5, 1.0)
    return min(cap_s, base_s * 2.0**attempt) * u


class RetryPolicy:
    """Retries one call on transient errors until it has failed for `window_s` seconds."""

    def __init__(self, window_s: float, base_s: float = 0.2, cap_s: float = 5.0):
        self.window_s, self.base_s, self.cap_s = window_s, base_s, cap_s
        self.retries = 0  # retries made by every call of this policy
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], what: str) -> T:
        """fn(), retried on transient errors; StoreUnavailable (naming `what` and the window)
        once it has failed for `window_s`."""
        first: float | None = None
        attempt = 0
        while True:
            try:
                out = fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if self.window_s <= 0:  # no retries: the caller handles the failure
                    raise StoreUnavailable(f"{what}: the store is unreachable: {_short(exc)}") from exc
                now = time.monotonic()
                if first is None:
                    first = now
                    log.warning("store error on %s (%s); retrying for up to %.0fs", what, _short(exc), self.window_s)
                left = first + self.window_s - now
                if left <= 0:
                    raise StoreUnavailable(
                        f"{what}: the store was unreachable for the whole retry window of {self.window_s:g}s "
                        f"(store_retry_s); last error: {_short(exc)}"
                    ) from exc
                with self._lock:
                    self.retries += 1
                time.sleep(min(left, backoff_s(attempt, self.base_s, self.cap_s)))
                attempt += 1
                continue
            if first is not None:
                log.warning("%s succeeded after %.1fs and %d retries", what, time.monotonic() - first, attempt)
            return out


POLICY = RetryPolicy(float(os.environ.get(RETRY_ENV) or DEFAULT_WINDOW_S))


def configure(window_s: float) -> None:
    """Set this process's retry window, and export it to the processes it starts."""
    POLICY.window_s = float(window_s)
    os.environ[RETRY_ENV] = f"{float(window_s):g}"


_nested = threading.local()


def retried(method: Callable[..., T]) -> Callable[..., T]:
    """Decorate a Store method: the outermost Store call on a thread is retried by the store's
    `retry` policy (a store call made inside another is retried as part of the outer one)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        if getattr(_nested, "depth", 0):
            return method(self, *args, **kwargs)

        def attempt() -> T:
            _nested.depth = 1
            try:
                return method(self, *args, **kwargs)
            finally:
                _nested.depth = 0

        rel = args[0] if args and isinstance(args[0], str) else ""
        return self.retry.call(attempt, f"{method.__name__} {self.url(rel)}")

    return wrapper


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
