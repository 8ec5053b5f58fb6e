"""Logging setup shared by every entry point, and quieting of chatty libraries.

What a run prints is its progress line, warnings and errors. Request-level detail (one line per
HTTP request of an agent to its proxy) belongs in the events (areal_core/events.py), so the
HTTP clients and servers log only warnings."""

from __future__ import annotations

import logging
import os

# loggers that write one INFO line per request: the openai SDK's HTTP clients (httpx, and the
# httpx2 fork newer SDKs vendor), their transports, servers' access logs
PER_REQUEST_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "openai",
    "uvicorn.access",
    "aiohttp.access",
    "urllib3",
    "botocore",
    "s3fs",
)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_libraries()


def quiet_libraries() -> None:
    """No per-request INFO lines from HTTP libraries, no per-file progress bars or deprecation
    chatter from transformers in role logs."""
    import warnings

    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
